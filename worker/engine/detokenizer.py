"""Incremental detokenization with stop strings.

Text grows by decoding a small window of recent tokens; a window whose decoding ends in
U+FFFD is half a UTF-8 character and waits for the next token. Stop strings are searched
only where new text could complete one, and streamed text holds back the last few
characters that could still become the start of a stop string.

Windows decode through the fast tokenizer's Rust object where transformers' own ``decode``
would only wrap it: that wrapper costs more than the decode itself, twice per token.
"""

from __future__ import annotations

from collections.abc import Callable

_REPLACEMENT = "\ufffd"


def window_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``,
    called on the ``tokenizers`` object directly when transformers' decode is exactly that call
    (a fast tokenizer whose class overrides neither step); otherwise transformers' decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _plain_fast_decode(type(tokenizer)):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _plain_fast_decode(cls: type) -> bool:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own decode
        return False
    return cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode


class IncrementalDetokenizer:
    __slots__ = ("_decode", "emitted", "include_stop", "max_stop_len", "prefix_offset", "read_offset",
                 "skip_special_tokens", "stop", "text", "tokenizer")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        # A few prompt tokens of context make the first output token decode as it would in place
        # (leading-space merging of sentencepiece-style decoders).
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.emitted = 0
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._decode = window_decoder(tokenizer, skip_special_tokens)

    def update(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Take the sequence's whole token list after a new token; returns the stop string
        that ended it, if one did (``self.text`` is then cut there). ``check_stop`` is False
        while min_tokens are not out: text then grows past stop strings untouched."""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        old_len = len(self.text)
        self.text += delta
        if not self.stop or not check_stop:
            return None
        search_from = max(old_len - self.max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[:at + len(s)] if self.include_stop else self.text[:at]
        return s

    def replay(self, token_ids: list[int], num_prompt_tokens: int, min_tokens: int) -> str | None:
        """Take a resumed sequence's outputs (``token_ids`` after its prompt) one at a time, as
        ``update`` took them where they were generated, so that ``text`` and the decode window end
        as the original's did. Returns the stop string they already hold, if one (text cut there)."""
        ids = token_ids[:num_prompt_tokens]
        for t in token_ids[num_prompt_tokens:]:
            ids.append(t)
            stop = self.update(ids, check_stop=len(ids) - num_prompt_tokens >= min_tokens)
            if stop is not None:
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what could begin a stop string."""
        end = len(self.text) if finished or not self.stop else max(len(self.text) - self.max_stop_len + 1,
                                                                    self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
