"""What the engine hands back: whole outputs (offline) and per-step deltas (streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's logprob and, when asked for, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` sequences: its whole output (offline), or its new output in one
    engine step (in a ``RequestOutputDelta``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class RequestOutputDelta:
    """One chunk of a request's stream: at most one per request per engine step."""

    request_id: str
    sequences: list[CompletionOutput]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
