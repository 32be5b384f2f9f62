"""What passes between the engine's step thread and its callers' event loops: the commands the
thread takes (``AsyncLLMEngine._apply_commands``), and how its deltas reach each request's
stream (held by ``--stream-interval``, forwarded, handed over in one call per loop)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pagefleet.worker.core.kv_events import KVEventBatch
from pagefleet.worker.engine.resumed import ResumedStart
from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.outputs import RequestOutputDelta, merge_deltas
from pagefleet.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(slots=True)
class AddRequest:
    """Engine-thread command: start a request (already checked by the caller)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    extra_keys: tuple
    block_hashes: bytes = b""
    grammar: "xgr.CompiledGrammar | None" = None  # params.structured_outputs', compiled
    resumed: ResumedStart | None = None  # a resumed sequence's start, built
    priority: int = 0  # vLLM's request priority (``LLMEngine.add_request``)
    lora_request: LoRARequest | None = None  # the adapter it runs with, registered (``LLMEngine.add_lora``)


@dataclass(slots=True)
class AbortRequest:
    """Engine-thread command: finish a request now and free its blocks."""

    request_id: str


@dataclass(slots=True)
class EnableKVEvents:
    """Engine-thread command: from now on, hand the KV event batches to ``sink`` (called on the
    engine thread: it must not block), after a step when ``ready`` says a batch would go out now."""

    worker_id: str
    sink: Callable[[KVEventBatch], None]
    ready: Callable[[], bool]


@dataclass(slots=True)
class TakeKVSnapshot:
    """Engine-thread command: resolve ``future`` (of ``loop``) with the KV cache's snapshot."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(slots=True)
class EngineCall:
    """Engine-thread command: resolve ``future`` (of ``loop``) with ``fn()``, run between two steps
    (what changes the engine's state outside a request: registering a LoRA adapter)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    fn: Callable


class HeldDeltas:
    """``--stream-interval N`` (vLLM's option): a request's deltas go to its stream once they hold
    N new tokens, its first and its last at once, so time to first token and the end are never held
    back. Each delta takes every hop to the client (the replica's loop, the channel, the ingress,
    one HTTP write); clients then see tokens in bursts of N. N = 1 hands every delta on as it
    comes."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[str, list[RequestOutputDelta]] = {}  # requests whose first delta went out
        self._tokens: dict[str, int] = {}  # new tokens in what each holds

    def release(self, delta: RequestOutputDelta) -> RequestOutputDelta | None:
        """What goes to ``delta``'s stream now: None while it is held, else everything held
        for its request merged with it."""
        if self.interval <= 1:
            return delta
        rid = delta.request_id
        held = self._held.get(rid)
        if held is None:  # the request's first delta (or a last one with nothing before it)
            if not delta.finished:
                self._held[rid], self._tokens[rid] = [], 0
            return delta
        held.append(delta)
        tokens = self._tokens[rid] + max((len(s.token_ids) for s in delta.sequences), default=0)
        if not delta.finished and tokens < self.interval:
            self._tokens[rid] = tokens
            return None
        if delta.finished:
            del self._held[rid], self._tokens[rid]
        else:
            self._held[rid], self._tokens[rid] = [], 0
        return merge_deltas(held)

    def __len__(self) -> int:
        return len(self._held)


class Forwarding(asyncio.Queue):
    """A stream's queue that hands its deltas on to ``forward`` as they are put, but the last one
    (and errors), which it keeps for the stream."""

    def __init__(self, forward: Callable[[RequestOutputDelta], None]) -> None:
        super().__init__()
        self.forward = forward
        self.closed = False

    def put_nowait(self, item) -> None:
        if self.closed:
            return
        if isinstance(item, RequestOutputDelta) and not item.finished:
            self.forward(item)
        else:
            super().put_nowait(item)


def put_all(items: list[tuple[asyncio.Queue, RequestOutputDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, compute: Callable) -> None:
    """Run ``compute`` here (the engine thread) and hand its result or error to ``future`` on ``loop``."""
    try:
        result, error = compute(), None
    except Exception as e:
        result, error = None, e

    def settle() -> None:
        if future.done():  # the caller gave up waiting
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    loop.call_soon_threadsafe(settle)
