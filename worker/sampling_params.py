"""Per-request sampling options (vLLM-shaped)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.structured.json_schema import unenforced_keyword

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
# Below this temperature sampling is greedy (as in vLLM): dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5
MAX_TOP_K = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A grammar is compiled from this text (worker/structured/): bounding it bounds the compile's input.
MAX_STRUCTURED_SPEC_BYTES = 64 * 1024
# bad_words are tokenized once per request on the engine's step thread: a bounded amount of work.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one of these is set."""

    json: str | None = None        # a JSON schema, as JSON text
    json_object: bool = False      # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None     # an EBNF grammar (xgrammar's GBNF dialect)

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self._validate()

    @property
    def kind(self) -> str:
        """The name of the one field that is set."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def _validate(self) -> None:
        def bad(why: str) -> InvalidRequest:
            return InvalidRequest(f"structured_outputs{why}", "structured_outputs")

        set_kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise bad(f" must set exactly one of {', '.join(_STRUCTURED_KINDS)}; got "
                      f"{', '.join(set_kinds) if set_kinds else 'none'}")
        kind = set_kinds[0]
        if kind == "json_object":
            if self.json_object is not True:
                raise bad(f".json_object must be a boolean, got {self.json_object!r}")
            return
        if kind == "choice" and (not isinstance(self.choice, list) or not self.choice):
            raise bad(".choice must be a list of at least one string")
        texts = self.choice if kind == "choice" else [getattr(self, kind)]
        if any(not isinstance(t, str) or not t for t in texts):
            raise bad(".choice must hold non-empty strings" if kind == "choice" else f".{kind} must be a non-empty "
                      "string")
        # Characters first: a text of more characters than the limit is over it without being encoded.
        if (sum(len(t) for t in texts) > MAX_STRUCTURED_SPEC_BYTES
                or sum(len(t.encode()) for t in texts) > MAX_STRUCTURED_SPEC_BYTES):
            raise bad(f".{kind} is longer than {MAX_STRUCTURED_SPEC_BYTES} bytes of UTF-8, the limit")
        if kind == "json":
            try:
                schema = json.loads(self.json)
            except RecursionError:
                raise bad(".json nests too deeply to parse") from None
            except ValueError as e:
                raise bad(f".json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad(f".json must be a JSON schema (an object or a boolean), got a {type(schema).__name__}")
            # What xgrammar would silently drop is refused: a 200 must honour the whole schema.
            unenforced = unenforced_keyword(schema)
            if unenforced is not None:
                keyword, path, why = unenforced
                raise bad(f'.json uses "{keyword}" at {path}: {why}')


def _clamped_bias(bias: dict) -> dict[int, float]:
    """vLLM's logit_bias: token ids (JSON sends them as strings) to biases clamped to [-100, 100]."""
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {bias!r}", "logit_bias")
    out = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {token!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"logit_bias values must be finite numbers, got {value!r}", "logit_bias")
        out[token_id] = min(100.0, max(-100.0, float(value)))
    return out


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``top_k`` of 0 or -1 disables top-k. ``logprobs`` is the number of top
    alternatives to return per token (0 returns only the chosen token's
    logprob); None returns no logprobs. ``max_tokens`` None means "until
    max_model_len".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: each prompt token's logprob and the top ones at its position (computed, never read
    # from the prefix cache). With it, max_tokens may be 0: the prompt alone is scored.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # False keeps special tokens in the text (a tool-call parser may read them: Mistral's [TOOL_CALLS]).
    skip_special_tokens: bool = True
    # Logits processors, as vLLM's: added to a token's logit (clamped to [-100, 100]); the only
    # tokens that may be sampled; words that may not be generated (worker/model_executor/
    # logits_processors.py).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = _clamped_bias(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            raise bad("max_tokens", "must be an integer >= 1 (>= 0 with prompt_logprobs)")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", "must be an integer that fits in a signed 64-bit integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be strings with a non-space character")
        if len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise bad("bad_words", f"may hold {MAX_BAD_WORDS} words of {MAX_BAD_WORD_CHARS} characters at most")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
