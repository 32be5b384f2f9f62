"""Incremental detokenization: never half a UTF-8 character; stop strings across tokens."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from pagefleet.worker.engine.detokenizer import IncrementalDetokenizer, _plain_fast_decode

TEXT = "héllo wörld, 你好 🙂 the end"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint(arch="llama")))


def split_char(tokenizer) -> str:
    """A character of TEXT whose UTF-8 bytes the tokenizer spreads over several tokens."""
    for ch in "你好🙂éö":
        if len(tokenizer.encode(ch, add_special_tokens=False)) > 1:
            return ch
    pytest.fail("the test tokenizer encodes every multi-byte character of TEXT as one token")


def stream(tokenizer, prompt: list[int], output: list[int], stop: list[str], include_stop=False):
    d = IncrementalDetokenizer(tokenizer, prompt, stop, include_stop)
    ids = list(prompt)
    chunks, reason = [], None
    for t in output:
        ids.append(t)
        reason = d.update(ids)
        chunks.append(d.take_new_text(reason is not None))
        if reason is not None:
            break
    return chunks, reason


def test_streamed_text_equals_full_decode_and_never_splits_a_character(tokenizer):
    split_char(tokenizer)
    prompt = tokenizer.encode("prompt:", add_special_tokens=False)
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks, reason = stream(tokenizer, prompt, output, [])
    assert reason is None
    assert "".join(chunks) == TEXT
    assert not any("\ufffd" in c for c in chunks)
    assert chunks.count("") >= 1  # some token ended mid-character and produced nothing yet


def test_stop_string_across_token_boundaries_cuts_text(tokenizer):
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "wörld, 你"
    # The stop string spans several tokens.
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    chunks, reason = stream(tokenizer, [], output, [stop, "never"])
    assert reason == stop
    assert "".join(chunks) == "héllo "
    chunks, _ = stream(tokenizer, [], output, [stop], include_stop=True)
    assert "".join(chunks) == "héllo wörld, 你"


def test_stop_string_inside_a_multibyte_character(tokenizer):
    ch = split_char(tokenizer)
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks, reason = stream(tokenizer, [], output, [ch])
    assert reason == ch
    assert "".join(chunks) == TEXT[:TEXT.index(ch)]


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    output = tokenizer.encode("abc the end", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], ["the end!"], False)
    ids = []
    emitted = ""
    for t in output:
        ids.append(t)
        assert d.update(ids) is None
        emitted += d.take_new_text(False)
        # Never hand out text that might still turn out to be the start of the stop string.
        assert len(d.text) - len(emitted) >= min(len(d.text), len("the end!") - 1)
    emitted += d.take_new_text(True)
    assert emitted == "abc the end"


def test_special_tokens_are_skipped_unless_the_request_keeps_them(tokenizer):
    """A tool-call parser that reads a special token (Mistral's [TOOL_CALLS]) needs it kept."""
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("prompt:", add_special_tokens=False)
    output = [*tokenizer.encode("a", add_special_tokens=False), eos, *tokenizer.encode("b", add_special_tokens=False)]
    for skip, want in ((True, "ab"), (False, f"a{tokenizer.eos_token}b")):
        d = IncrementalDetokenizer(tokenizer, prompt, [], False, skip_special_tokens=skip)
        ids = list(prompt)
        for t in output:
            ids.append(t)
            d.update(ids)
        assert d.take_new_text(True) == want


def test_the_fast_decode_streams_what_transformers_decode_streams(tokenizer):
    """The demo tokenizer takes the direct ``tokenizers`` call; over random ids, special ones
    among them, every step's text is what transformers' own decode gives it."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    assert _plain_fast_decode(type(tokenizer))
    rng = random.Random(7)
    specials = tokenizer.all_special_ids
    prompt = tokenizer.encode("prompt:", add_special_tokens=False)
    output = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
              for _ in range(400)]

    class ViaTransformers(type(tokenizer)):  # the same tokenizer, through transformers' decode
        def decode(self, *args, **kwargs):
            return PreTrainedTokenizerBase.decode(self, *args, **kwargs)

    slow = copy.copy(tokenizer)
    slow.__class__ = ViaTransformers
    assert not _plain_fast_decode(ViaTransformers)
    for skip in (True, False):
        fast_d = IncrementalDetokenizer(tokenizer, prompt, [], False, skip_special_tokens=skip)
        slow_d = IncrementalDetokenizer(slow, prompt, [], False, skip_special_tokens=skip)
        ids = list(prompt)
        for t in output:
            ids.append(t)
            fast_d.update(ids)
            slow_d.update(ids)
            assert fast_d.take_new_text(False) == slow_d.take_new_text(False)
        assert fast_d.text == slow_d.text == tokenizer.decode(output, skip_special_tokens=skip,
                                                              clean_up_tokenization_spaces=False)


def test_a_tokenizer_that_overrides_decoding_keeps_its_own(tokenizer):
    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    loud = copy.copy(tokenizer)
    loud.__class__ = Shouting
    output = tokenizer.encode("abc the end", add_special_tokens=False)
    d = IncrementalDetokenizer(loud, [], [], False)
    ids = []
    for t in output:
        ids.append(t)
        d.update(ids)
    assert d.take_new_text(True) == "ABC THE END"
