"""What the engine hands back: whole outputs (offline) and per-step deltas (streaming).

msgspec structs: plain data that a replica's delta channel encodes as it is
(``worker.replica.wire``), field order on the wire being declaration order.
"""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """The chosen token's logprob and, when asked for, the top alternatives."""

    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing precedes (echo)
    top: list[tuple[int, float]] = []
    rank: int | None = None  # the token's rank in the vocabulary (1: the most likely); prompt logprobs'


class CompletionOutput(msgspec.Struct, array_like=True, gc=False):
    """One of a request's ``n`` sequences: its whole output (offline), or its new output in one
    engine step (in a ``RequestOutputDelta``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class RequestOutputDelta(msgspec.Struct, array_like=True, gc=False):
    """One chunk of a request's stream: at most one per request per engine step."""

    request_id: str
    sequences: list[CompletionOutput]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    # With SamplingParams.prompt_logprobs, in the request's first delta with output: one entry a
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class RequestOutput(msgspec.Struct, gc=False):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None


def append_output(into: CompletionOutput, *new: CompletionOutput) -> None:
    """Extends ``into`` with the next outputs of the same sequence, oldest first: texts, token ids
    and logprobs joined in order (each once: linear in what is added), the latest finish kept. The
    one place outputs accumulate."""
    into.text += "".join(n.text for n in new)
    for n in new:
        into.token_ids.extend(n.token_ids)
        if n.logprobs is not None:
            if into.logprobs is None:
                into.logprobs = []
            into.logprobs.extend(n.logprobs)
    if new:
        into.finish_reason, into.stop_reason = new[-1].finish_reason, new[-1].stop_reason


def merge_deltas(deltas: list[RequestOutputDelta]) -> RequestOutputDelta:
    """One delta for consecutive deltas of one request, oldest first: what a consumer slower than
    the engine missed, in one chunk. Per sequence its texts, token ids and logprobs are joined in
    order and the latest finish is kept; the prompt and cache counts are the first delta's."""
    if len(deltas) == 1:
        return deltas[0]
    by_index: dict[int, list[CompletionOutput]] = {}
    for delta in deltas:
        for seq in delta.sequences:
            by_index.setdefault(seq.index, []).append(seq)
    merged = []
    for index in sorted(by_index):
        into = CompletionOutput(index, "", [], None, None)
        append_output(into, *by_index[index])
        merged.append(into)
    first = deltas[0]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return RequestOutputDelta(first.request_id, merged, first.num_prompt_tokens, first.num_cached_tokens,
                              deltas[-1].finished, prompt_logprobs)
