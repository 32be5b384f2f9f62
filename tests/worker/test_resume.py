"""A resumed sequence (mid-stream failover, ``core.resume``) continues the uninterrupted one: the
original's deltas up to token k joined with the resumed request's deltas are the uninterrupted
output, for cuts anywhere (before the first token, inside a character's bytes, before the last),
greedy and seeded, across stop strings, min_tokens, penalties, grammars and n = 2.

The resumed request runs on the same engine as the original (its prefix cache then holds the
original's blocks, as a replica that served the prompt before would): the computation differs
anyway, a prefill of the prompt and resumed outputs where the original decoded them one by one."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import jsonschema
import pytest
import torch

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta, append_output
from pagefleet.worker.request_check import InvalidRequest

PROMPT_TEXT = "你好 🙂 héllo wörld"
BLOCK_SIZE = 16
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["city", "zip"],
    "additionalProperties": False,
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint(arch="llama"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = LLMEngine(EngineArgs(model=checkpoint, dtype="float32", kv_cache_bytes=32 << 20, block_size=BLOCK_SIZE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode(PROMPT_TEXT)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
        resume: ResumeState | None = None) -> list[RequestOutputDelta]:
    """Every delta of one request, one per engine step."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, prompt, params, resume=resume)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert all(d.request_id == rid for d in deltas)
    return deltas


def pieces(deltas: list[RequestOutputDelta], index: int = 0) -> list[CompletionOutput]:
    return [s for d in deltas for s in d.sequences if s.index == index]


def joined(parts: list[CompletionOutput], index: int = 0) -> CompletionOutput:
    out = CompletionOutput(index, "", [], None, None)
    append_output(out, *parts)
    return out


def cut(parts: list[CompletionOutput], k: int) -> tuple[list[CompletionOutput], ResumeState]:
    """The original's pieces through its k-th token, and the state a failover resumes from then:
    every piece of an uninterrupted run holds one token."""
    assert all(len(p.token_ids) == 1 for p in parts)
    head = parts[:k]
    tokens = [p.token_ids[0] for p in head]
    return head, ResumeState(tokens, sum(len(p.text) for p in head), parts[0].index)


def assert_same_output(got: CompletionOutput, want: CompletionOutput, where: str) -> None:
    assert got.token_ids == want.token_ids, where
    assert got.text == want.text, where
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason), where
    if want.logprobs is None:
        assert got.logprobs is None, where
        return
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got.logprobs] == \
        [(lp.token_id, [t for t, _ in lp.top]) for lp in want.logprobs], where
    # The first resumed token's logits come from a prefill where the original's came from a decode
    # step: different matmul shapes, so the same fp32 values up to a few ulps (on CPU at most
    # 4.8e-7 here, half an ulp at |x| in [4, 8)). Four ulps of the value allow that, nothing more.
    got_values = torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in got.logprobs])
    want_values = torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in want.logprobs])
    ulp = torch.finfo(torch.float32).eps * want_values.abs().clamp(min=1.0)
    assert ((got_values - want_values).abs() <= 4 * ulp).all(), where


def mid_character_cut(parts: list[CompletionOutput]) -> int:
    """A k whose first k tokens end inside a character's UTF-8 bytes (the k-th piece's text is
    empty: the detokenizer waits for the rest of the character)."""
    for k, p in enumerate(parts, 1):
        if p.text == "" and k < len(parts) - 1:
            return k
    pytest.fail("no token of the output ends mid-character")


def cuts_of(parts: list[CompletionOutput]) -> list[int]:
    return sorted({0, 1, mid_character_cut(parts), len(parts) // 2, len(parts) - 1})


def assert_resumes_anywhere(engine, prompt, params, cuts=None, index=0) -> list[CompletionOutput]:
    whole_run = pieces(run(engine, prompt, params), index)
    whole = joined(whole_run, index)
    for k in cuts or cuts_of(whole_run):
        head, resume = cut(whole_run, k)
        deltas = run(engine, prompt, dataclasses.replace(params, n=1), resume)
        assert deltas[0].num_prompt_tokens == len(prompt)
        assert all(s.index == index for d in deltas for s in d.sequences)
        assert_same_output(joined(head + pieces(deltas, index), index), whole, f"cut at k={k}")
    return whole_run


def test_greedy_resumed_anywhere_continues_the_uninterrupted_output(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    whole = assert_resumes_anywhere(engine, prompt, params)
    assert len(whole) == 40 and whole[-1].finish_reason == "length"


def test_seeded_sampling_resumed_anywhere_draws_what_the_uninterrupted_run_drew(engine, prompt):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, logprobs=1)
    whole = assert_resumes_anywhere(engine, prompt, params)
    greedy = pieces(run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    assert [p.token_ids for p in whole] != [p.token_ids for p in greedy]  # it did sample


def test_the_replay_counts_as_prompt_work_and_hits_the_prefix_cache(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    whole = pieces(run(engine, prompt, params))  # its blocks stay in the prefix cache
    k = 30
    before = engine.stats()
    deltas = run(engine, prompt, params, cut(whole, k)[1])
    after = engine.stats()
    # Every full block of prompt + resumed output the original computed is found; the last token is
    # never taken from the cache (its logits are needed).
    assert deltas[0].num_cached_tokens == (len(prompt) + k - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert after.prompt_tokens_total - before.prompt_tokens_total == len(prompt) + k
    assert after.generation_tokens_total - before.generation_tokens_total == 40 - k


def test_a_stop_string_across_the_seam_is_found_and_held_back_text_is_sent(engine, prompt):
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = pieces(run(engine, prompt, base))
    text = joined(free).text
    # A seam after token k, inside a 7-character stop string that starts 3 characters before it
    # (its first occurrence), the seam past the first 6 characters.
    ends = list(itertools.accumulate(len(p.text) for p in free))
    k = next(k for k in range(1, 39) if ends[k - 1] >= 6 and ends[k - 1] + 4 <= len(text)
             and text.find(text[ends[k - 1] - 3:ends[k - 1] + 4]) == ends[k - 1] - 3)
    seam = ends[k - 1]
    stop = text[seam - 3:seam + 4]
    for include in (False, True):
        params = dataclasses.replace(base, stop=[stop], include_stop_str_in_output=include)
        whole_run = pieces(run(engine, prompt, params))
        whole = joined(whole_run)
        assert (whole.finish_reason, whole.stop_reason) == ("stop", stop)
        assert whole.text == text[:seam + 4 if include else seam - 3]
        head, resume = cut(whole_run, k)
        # The original held back the last len(stop) - 1 characters it had: they could begin the stop.
        assert resume.emitted_text_chars == seam - 6
        resumed = pieces(run(engine, prompt, params, resume))
        assert joined(resumed).text == whole.text[seam - 6:]  # the held-back text, sent by the new replica
        assert_same_output(joined(head + resumed), whole, f"include_stop_str_in_output={include}")


def test_min_tokens_and_max_tokens_count_the_resumed_outputs(engine, prompt):
    free = [p.token_ids[0] for p in pieces(run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                                             ignore_eos=True)))]
    # A stop token first produced at position j (>= 6): with min_tokens = j it is allowed exactly
    # there. A resumed sequence that counted only its new tokens would still ban it at j.
    j = next(j for j in range(6, 40) if free[j] not in free[:j])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[free[j]], min_tokens=j)
    whole = assert_resumes_anywhere(engine, prompt, params, cuts=[0, 1, j // 2, j])
    assert [p.token_ids[0] for p in whole] == free[:j + 1]
    assert (whole[-1].finish_reason, whole[-1].stop_reason) == ("stop", free[j])
    # max_tokens: resumed one short of it, the sequence takes one token and ends with "length".
    capped = dataclasses.replace(params, max_tokens=j)
    capped_run = pieces(run(engine, prompt, capped))
    assert len(capped_run) == j and capped_run[-1].finish_reason == "length"
    last = pieces(run(engine, prompt, capped, cut(capped_run, j - 1)[1]))
    assert [(p.token_ids, p.finish_reason) for p in last] == [([free[j - 1]], "length")]


def test_penalties_count_the_resumed_outputs(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=1.0, logprobs=1)
    whole = assert_resumes_anywhere(engine, prompt, params)
    free = pieces(run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    assert [p.token_ids for p in whole] != [p.token_ids for p in free]  # the penalties did change it


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5)])
def test_a_grammar_resumes_where_it_was(engine, prompt, temperature, seed):
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(CITY)))
    whole_run = pieces(run(engine, prompt, params))
    whole = joined(whole_run)
    jsonschema.validate(json.loads(whole.text), CITY)
    assert whole.finish_reason == "stop" and whole.token_ids[-1] in engine.model_config.eos_token_ids
    n = len(whole_run)
    assert_resumes_anywhere(engine, prompt, params, cuts=[0, 1, n // 3, n // 2, n - 1])
    # Resumed with all of it, the grammar is complete: done at once, nothing new.
    done = run(engine, prompt, params, ResumeState(whole.token_ids, len(whole.text), 0))
    assert [(s.token_ids, s.text, s.finish_reason) for d in done for s in d.sequences] == [([], "", "stop")]


def test_a_resumed_token_the_grammar_refuses_is_an_invalid_request(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(CITY)))
    not_json = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="refused by the request's structured_outputs grammar") as err:
        engine.add_request("refused", prompt, params, resume=ResumeState(not_json, 0, 0))
    assert err.value.param == "resume"
    assert not engine.has_unfinished()


def test_each_of_n_sequences_resumes_alone_under_its_index(engine, prompt):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=30, ignore_eos=True, logprobs=1)
    whole = run(engine, prompt, params)
    assert [p.token_ids for p in pieces(whole, 0)] != [p.token_ids for p in pieces(whole, 1)]
    for index in (0, 1):
        assert_resumes_anywhere(engine, prompt, params, cuts=[0, 1, 15, 29], index=index)


def test_a_resumed_output_already_done_finishes_at_once(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    whole = joined(pieces(run(engine, prompt, params)))
    # At max_tokens, two characters not yet sent: they go out, with "length" and no token.
    deltas = run(engine, prompt, params, ResumeState(whole.token_ids, len(whole.text) - 2, 0))
    assert [(d.finished, d.num_prompt_tokens) for d in deltas] == [(True, len(prompt))]
    assert [(s.token_ids, s.text, s.finish_reason) for s in deltas[0].sequences] == \
        [([], whole.text[-2:], "length")]
    # EOS last (and EOS not ignored): "stop".
    eos = engine.model_config.eos_token_ids[0]
    deltas = run(engine, prompt, dataclasses.replace(params, ignore_eos=False),
                 ResumeState(whole.token_ids[:3] + [eos], 0, 0))
    assert [(s.token_ids, s.finish_reason, s.stop_reason) for d in deltas for s in d.sequences] == \
        [([], "stop", None)]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize("params,resume,param,message", [
    (SamplingParams(n=2), ResumeState([5], 0, 0), "n", "n must be 1"),
    (SamplingParams(max_tokens=2), ResumeState([5, 6, 7], 0, 0), "resume", "more than max_tokens"),
    (SamplingParams(), ResumeState([5, 1000], 0, 0), "resume", "outside the vocabulary"),
    (SamplingParams(), ResumeState([5], -1, 0), "resume", "emitted_text_chars must be"),
    (SamplingParams(), ResumeState([5], 0, -1), "resume", "seq_index must be"),
    (SamplingParams(), ResumeState([5], 50, 0), "resume", "more than the 1 characters"),
])
def test_impossible_resume_states_are_invalid_requests(engine, prompt, params, resume, param, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        engine.add_request("bad", prompt, params, resume=resume)
    assert err.value.param == param
    assert not engine.has_unfinished()


def test_async_engine_resumes_through_generate(checkpoint, engine, prompt):
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True, stop=["zz"])
    whole_run = pieces(run(engine, prompt, params))
    head, resume = cut(whole_run, 9)
    eng = AsyncLLMEngine(EngineArgs(model=checkpoint, dtype="float32", kv_cache_bytes=16 << 20))

    async def collect(rid, p, r):
        return [d async for d in eng.generate(rid, prompt, p, resume=r)]

    try:
        deltas = asyncio.run(collect("resumed", params, resume))
        with pytest.raises(InvalidRequest, match="n must be 1"):
            asyncio.run(collect("n2", dataclasses.replace(params, n=2), resume))
    finally:
        eng.shutdown()
    assert_same_output(joined(head + pieces(deltas)), joined(whole_run), "async")
