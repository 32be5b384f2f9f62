"""What the ingress sends a worker replica for one engine request (plain data, crosses Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.worker.sampling_params import SamplingParams


@dataclass(slots=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The prompt's full-block hashes under ``extra_keys``, packed (16 bytes each), computed once
    # by the ingress: the worker uses them instead of hashing again, the routers route by them.
    block_hashes: bytes = b""
    extra_keys: tuple = ()  # what changes KV content besides tokens: the request's cache salt
    # Replica ids the global scheduler ranked for this request, best first (None: no ranking,
    # the request router decides alone). Read by the request router; the worker ignores it.
    ranking: list[str] | None = None
