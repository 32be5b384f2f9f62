"""``--routing ray_prefix``: Ray Serve LLM's own prefix-aware router over pagefleet's workers.

``PrefixCacheAffinityRouter`` (public as ``ray.serve.llm.request_router``) is the router a Ray
user would pick for shared prefixes: it keeps a character prefix tree of the prompts it routed
per replica and sends a request to the replica with the longest match while queue lengths are
balanced. It is here as the peer ``kv`` is measured against, with Ray's defaults.

It reads the prompt as text from the call's argument; pagefleet's workers take token ids, so
the text is one character per token id (a prefix of tokens is then a prefix of characters, as a
prefix of text is for Ray's own deployments). A delta channel stays on its replica as with every
pagefleet router. The class is imported from Ray's internal module because the public one,
``ray.serve.llm``, imports pyarrow through Ray Data, which a serving install does not need.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.request_router import FIFOMixin, PendingRequest, RunningReplica

from pagefleet.router.routing.request_router import _channel_open, _worker_request
from pagefleet.worker.replica.wire import WorkerRequest

# Past the ASCII and Latin-1 controls, so every token id is one printable code point.
TOKEN_CHAR_BASE = 0x100


def prompt_text(request: WorkerRequest) -> str:
    """The prompt as Ray's router matches it: one character per token id, salted so that two
    tenants' identical tokens (different KV under different cache salts) do not match, nor the
    same tokens under two LoRA adapters (a routing hint only: the KV cache keys blocks by adapter)."""
    salt = "".join(str(k) for k in request.extra_keys)
    if request.lora_name is not None:
        salt += "\x01" + request.lora_name
    return salt + "\x00" + "".join(chr(TOKEN_CHAR_BASE + t) for t in request.prompt_token_ids)


class RayPrefixCacheRouter(FIFOMixin, PrefixCacheAffinityRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        channel = _channel_open(pending_request)
        if channel is not None:
            return [[r] for r in candidate_replicas if r.replica_id.unique_id == channel.replica_id]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        request = _worker_request(pending_request)
        if request is None:
            raise ValueError("not a WorkerRequest: no prompt to match")
        return prompt_text(request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if _worker_request(pending_request) is not None:  # a channel is no prompt
            super().on_request_routed(pending_request, replica_id, result)
