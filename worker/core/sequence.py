"""One generated sequence's state. A request with ``n > 1`` is ``n`` sequences."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagefleet.worker.lora.request import LoRARequest
    from pagefleet.worker.structured.matcher import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Progress is one counter: ``num_computed_tokens`` catches up with ``num_tokens``.
    Prefill, prompt chunks, prefix hits, recompute after preemption and decode are
    all the same operation."""

    __slots__ = ("seq_id", "request_id", "index", "params", "token_ids", "num_prompt_tokens",
                 "num_resumed_tokens", "num_computed_tokens", "num_cached_tokens", "status", "finish_reason",
                 "stop_reason", "logprobs", "parent", "extra_digest", "block_hashes", "penalties", "grammar",
                 "bad_words_ids", "prompt_logprobs", "priority", "lora_request")

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, parent: "Sequence | None" = None,
                 extra_digest: bytes = b"", grammar: "SequenceGrammar | None" = None,
                 resumed_token_ids: list[int] = (), priority: int = 0,
                 lora_request: "LoRARequest | None" = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        # The request's priority (vLLM's): under --scheduling-policy priority lower values are
        # admitted first and preempted last (core.request_queue).
        self.priority = priority
        self.lora_request = lora_request  # the LoRA adapter it runs with; None: the base model
        self.token_ids = [*prompt_token_ids, *resumed_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        # Output tokens another replica generated before this sequence was resumed here
        # (core.resume): outputs for every rule, but never handed out again.
        self.num_resumed_tokens = len(resumed_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # tokens (prompt, resumed outputs) from the prefix cache at first admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # One per output token generated here (the resumed ones' went out from their replica).
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.parent = parent  # the sequence whose prompt blocks this one shares (n > 1)
        self.extra_digest = extra_digest  # what changes KV content besides tokens: block_hash.extra_keys_digest
        self.block_hashes: list = []  # chained hashes of this sequence's full blocks, filled lazily
        self.penalties = None  # the sampler's PenaltyState, once a penalty asks for it
        # structured_outputs' matcher: its bitmask constrains every sampled token (a resumed
        # sequence's has accepted the resumed outputs already)
        self.grammar = grammar
        self.bad_words_ids: list[list[int]] | None = None  # params.bad_words tokenized, on first use
        # With params.prompt_logprobs: one entry a prompt token, filled as its position is computed
        # (a recompute after preemption writes the same values again).
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new_output_tokens(self) -> int:
        """Output tokens generated on this engine (not resumed)."""
        return self.num_output_tokens - self.num_resumed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """The one place a sampled token is added, so the grammar accepts each output token once."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, {self.status.value})")


def finish_reason(seq: Sequence, stop_str: str | None, eos_token_ids: tuple[int, ...],
                  max_model_len: int) -> tuple[str, str | int | None] | None:
    """Why ``seq`` ends after its newest token, as (finish_reason, stop_reason), or None.

    Precedence: a complete grammar, EOS, a stop token id, a stop string (found by the detokenizer),
    then length. Nothing but a complete grammar or length ends a sequence before ``min_tokens`` are
    out; a complete grammar ends it even with ``ignore_eos`` (there is no token it could add)."""
    p = seq.params
    token = seq.token_ids[-1]
    if seq.grammar is not None and seq.grammar.done:
        return "stop", None
    if seq.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if stop_str is not None:
            return "stop", stop_str
    if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len:
        return "length", None
    return None
