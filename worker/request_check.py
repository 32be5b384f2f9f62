"""The one check of a request against what the served model and engine can take.

Pure: token ids, ``SamplingParams`` (whose own fields check their ranges when
built) and ``RequestLimits``. The ingress calls it before anything is queued,
so bad requests never reach a worker; the engine calls the same function at
its own entry points (``LLM.generate``, the replica), because a token id
outside the vocabulary would otherwise fail a whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagefleet.worker.engine_args import EngineArgs
    from pagefleet.worker.model_executor.model_config import ModelConfig
    from pagefleet.worker.sampling_params import SamplingParams

# The engine's one thread scans every stop string and stop token id of every running sequence
# after each token: these bound that work per request (EngineArgs' defaults).
DEFAULT_MAX_STOP_STRINGS = 32
DEFAULT_MAX_STOP_STRING_CHARS = 512
DEFAULT_MAX_STOP_TOKEN_IDS = 128


# OpenAI's error code for a prompt (plus the tokens asked for) longer than the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# OpenAI's error code for a model (here also a LoRA adapter) the server does not serve: a 404.
MODEL_NOT_FOUND = "model_not_found"


class InvalidRequest(ValueError):
    """A request that can never be served; ``param`` names the offending field (OpenAI's ``param``),
    ``code`` is OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True, frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    scheduling_policy: str = "fcfs"  # the engines' (EngineArgs.scheduling_policy)

    @classmethod
    def of(cls, cfg: "ModelConfig", args: "EngineArgs") -> "RequestLimits":
        """The limits of an engine with these options serving this model (the ingress reads the same)."""
        return cls(vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                   max_stop_token_ids=args.max_stop_token_ids, scheduling_policy=args.scheduling_policy)


def check_request(prompt_token_ids: list[int], params: "SamplingParams", limits: RequestLimits) -> None:
    """Raise ``InvalidRequest`` for a request that can never be served."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt must not be empty", "prompt")
    if n >= limits.max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                             f"your prompt has {n} tokens, leaving no room for a completion.", "prompt",
                             CONTEXT_LENGTH_EXCEEDED)
    if params.max_tokens is not None and n + params.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    if n + params.min_tokens > limits.max_model_len:
        raise InvalidRequest(f"min_tokens ({params.min_tokens}) does not fit beside the prompt ({n} tokens) "
                             f"within the maximum context length of {limits.max_model_len} tokens", "min_tokens",
                             CONTEXT_LENGTH_EXCEEDED)
    # Sizes first: only a prompt that fits is scanned token by token.
    bad = _first_outside_vocab(prompt_token_ids, limits.vocab_size)
    if bad is not None:
        raise InvalidRequest(f"token id {prompt_token_ids[bad]!r} is outside the vocabulary "
                             f"[0, {limits.vocab_size})", "prompt")
    if params.n > limits.max_num_seqs:
        raise InvalidRequest(f"n ({params.n}) must be <= max_num_seqs ({limits.max_num_seqs})", "n")
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"stop has {len(params.stop)} strings; at most {limits.max_stop_strings} are "
                             "allowed (max_stop_strings)", "stop")
    longest = max(map(len, params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise InvalidRequest(f"a stop string of {longest} characters is longer than the "
                             f"{limits.max_stop_string_chars} allowed (max_stop_string_chars)", "stop")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"stop_token_ids has {len(params.stop_token_ids)} ids; at most "
                             f"{limits.max_stop_token_ids} are allowed (max_stop_token_ids)", "stop_token_ids")
    for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids)):
        if ids is not None and len(ids) > limits.vocab_size:
            raise InvalidRequest(f"{name} names {len(ids)} tokens, more than the vocabulary's {limits.vocab_size}", name)
        bad = None if ids is None else _first_outside_vocab(ids, limits.vocab_size)
        if bad is not None:
            raise InvalidRequest(f"{name} token id {ids[bad]!r} is outside the vocabulary [0, {limits.vocab_size})",
                                 name)
    bad = _first_outside_vocab(params.stop_token_ids, limits.vocab_size)
    if bad is not None:
        raise InvalidRequest(f"stop token id {params.stop_token_ids[bad]!r} is outside the vocabulary "
                             f"[0, {limits.vocab_size})", "stop_token_ids")


def check_priority(priority: int, limits: RequestLimits) -> None:
    """Raise ``InvalidRequest`` for a priority the engines cannot honour. vLLM documents that a
    priority other than 0 is an error unless the server schedules by priority: a server that
    would serve it first come, first served refuses it rather than ignore it."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
        raise InvalidRequest(f"priority must be an integer that fits in a signed 64-bit integer, got {priority!r}",
                             "priority")
    if priority != 0 and limits.scheduling_policy != "priority":
        raise InvalidRequest(f"priority {priority} needs a server started with --scheduling-policy priority; "
                             f"this one schedules {limits.scheduling_policy} (only priority 0)", "priority",
                             "unsupported")


def _first_outside_vocab(token_ids: list[int], vocab_size: int) -> int | None:
    """The index of the first entry that is not a token id of the vocabulary, or None."""
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            return i
    return None
