"""vLLM's request logits processors through the engine: ``allowed_token_ids``, ``bad_words`` and
``logit_bias`` change what is sampled exactly as their definitions say, held to transformers'
logits of the same checkpoint; logprobs stay the model's own; refusals name the field."""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sample.logits_processors import bad_words_token_ids, banned_by_bad_words

from hf_reference import hf_model

PROMPT = [5, 17, 250, 31, 77, 9]
MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint(arch="llama"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def llm(request, checkpoint):
    return LLM(model=checkpoint, dtype="float32", device="cpu", kv_cache_bytes=8 << 20, enforce_eager=True,
               async_output_proc=request.param, async_scheduling=request.param)


def _greedy(llm, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, **kwargs)
    return llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]


def _reference(checkpoint, pick) -> list[int]:
    """Greedy decoding by transformers where ``pick(logits [V], output so far)`` chooses each token."""
    model, out = hf_model(checkpoint), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(input_ids=torch.tensor([PROMPT + out])).logits[0, -1]
            out.append(pick(logits.clone(), out))
    return out


def test_allowed_token_ids_restrict_the_argmax(llm, checkpoint):
    allowed = [3, 40, 41, 99, 512, 700]
    out = _greedy(llm, allowed_token_ids=allowed)

    def pick(logits, _):
        return allowed[int(logits[allowed].argmax())]

    assert out.token_ids == _reference(checkpoint, pick)
    plain = _greedy(llm)
    assert out.token_ids != plain.token_ids
    # The logprobs reported are the model's own, not renormalized over the allowed set.
    model_logprobs = [float(hf_model(checkpoint)(input_ids=torch.tensor([PROMPT + out.token_ids[:i]])).logits[0, -1]
                            .log_softmax(-1)[t]) for i, t in enumerate(out.token_ids[:3])]
    assert [lp.logprob for lp in out.logprobs[:3]] == pytest.approx(model_logprobs, abs=1e-5)


def test_logit_bias_adds_to_the_logits_and_is_clamped(llm, checkpoint):
    plain = _greedy(llm)
    first = plain.token_ids[0]
    # -1e9 is clamped to -100 (vLLM's range): with the tiny model's logits that still bans `first`.
    bias = {first: -1e9, 123: 4.0}
    out = _greedy(llm, logit_bias=bias)

    def pick(logits, _):
        logits[first] -= 100.0
        logits[123] += 4.0
        return int(logits.argmax())

    assert out.token_ids == _reference(checkpoint, pick)
    assert out.token_ids[0] != first
    assert _greedy(llm, logit_bias={"77": 100}).token_ids == [77] * MAX_NEW  # JSON keys are strings


def test_bad_words_are_never_completed(llm, checkpoint):
    tokenizer = llm.tokenizer
    plain = _greedy(llm).token_ids
    # A two-token word the plain output writes, and a one-token one.
    two = tokenizer.decode(plain[2:4])
    one = tokenizer.decode(plain[:1])
    words = bad_words_token_ids(tokenizer, [two, one])
    assert plain[2:4] in words and plain[:1] in words
    out = _greedy(llm, bad_words=[two, one]).token_ids

    def pick(logits, so_far):
        for token in banned_by_bad_words(words, so_far):
            logits[token] = float("-inf")
        return int(logits.argmax())

    assert out == _reference(checkpoint, pick)
    assert out[0] != plain[0]
    assert not any(out[i:i + len(w)] == w for w in words for i in range(len(out)))


def test_banned_by_bad_words_bans_the_completing_token_only():
    words = [[7], [3, 4, 5]]
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [1, 3, 4]) == [7, 5]
    assert banned_by_bad_words(words, [3, 4, 1]) == [7]


@pytest.mark.parametrize("params,field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 1000]), "allowed_token_ids"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={1000: 1.0}), "logit_bias"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=["w"] * 129), "bad_words"),
])
def test_bad_processor_fields_are_refused_by_name(llm, params, field):
    with pytest.raises(InvalidRequest) as err:
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, **params))
    assert err.value.param == field
    assert not llm.engine.has_unfinished()
