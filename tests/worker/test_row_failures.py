"""A sampling row with no token to sample (a grammar that allows nothing, logits that are NaN or
infinite, a grammar whose bitmask cannot be filled) ends its own sequence, in the step it
happens, in every step mode; its batch-mates finish exactly as they would alone, and every
block comes back."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar as xgr

from pagefleet.worker import LLM, SamplingParams, StructuredOutputsParams
from pagefleet.worker.sample.sampler import in_vocabulary

# (async output processing, async scheduling)
MODES = [(False, False), (True, False), (True, True)]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
PLAIN = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=1, seed=3, max_tokens=8, ignore_eos=True, logprobs=2),
         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)]


def _llm(checkpoint, async_output: bool, async_scheduling: bool) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", device="cpu", enforce_eager=True, kv_cache_bytes=4 << 20,
               max_num_seqs=8, async_output_proc=async_output, async_scheduling=async_scheduling)


def _outputs(results):
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [lp.logprob for lp in c.logprobs]) for c in r.outputs]
            for r in results]


def _alone(checkpoint):
    llm = _llm(checkpoint, False, False)
    return _outputs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PLAIN))


def _regex(pattern: str, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern), **kwargs)


def test_in_vocabulary_keeps_finite_choices_and_zeroes_the_rest():
    inf, nan = math.inf, math.nan
    logits = torch.tensor([[0.0, 2.0, 1.0],        # a plain row
                           [-inf, -inf, -inf],      # everything masked
                           [0.0, nan, 1.0],         # NaN: argmax picks it
                           [0.0, inf, 1.0],         # +inf
                           [0.0, 1.0, 2.0]])        # an inverse CDF that ran past the end
    tokens = torch.tensor([1, 0, 1, 1, 3])
    ids, valid = in_vocabulary(tokens, logits)
    assert ids.tolist() == [1, 0, 0, 0, 0]
    assert valid.tolist() == [True, False, False, False, False]


@pytest.mark.parametrize("async_output,async_scheduling", MODES)
def test_a_grammar_that_allows_nothing_ends_its_request_alone(tiny_checkpoint, async_output, async_scheduling):
    checkpoint = tiny_checkpoint(arch="llama")
    expected = _alone(checkpoint)
    llm = _llm(checkpoint, async_output, async_scheduling)
    # An empty language from the start, and one that allows "a" and then nothing; logprobs and a
    # random draw are what made the id vocab_size reach a gather and an embedding. The compile
    # step refuses the first (a 400); compiled straight by xgrammar here, it tests the step's guard.
    grammars = llm.engine.grammars
    compile_ = grammars.compile

    def compile_unchecked(params, client=""):
        if params.regex == "[^\\s\\S]":
            return xgr.GrammarCompiler(grammars.tokenizer_info()).compile_regex(params.regex)
        return compile_(params, client)

    grammars.compile = compile_unchecked
    poison = [_regex("[^\\s\\S]", temperature=1, logprobs=1, max_tokens=8),
              _regex("a[^\\s\\S]", temperature=1, seed=1, logprobs=1, max_tokens=8)]
    a_id = llm.tokenizer.convert_tokens_to_ids("a")
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [[20, 21], [22, 23, 24]]], PLAIN + poison)
    assert _outputs(results[:3]) == expected
    empty, after_a = (r.outputs[0] for r in results[3:])
    assert (empty.token_ids, empty.text, empty.finish_reason, empty.logprobs) == ([], "", "stop", [])
    assert (after_a.token_ids, after_a.text, after_a.finish_reason) == ([a_id], "a", "stop")
    assert [lp.token_id for lp in after_a.logprobs] == [a_id]
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("async_output,async_scheduling", MODES)
def test_non_finite_logits_end_that_row_alone(tiny_checkpoint, async_output, async_scheduling):
    checkpoint = tiny_checkpoint(arch="llama")
    expected = _alone(checkpoint)
    llm = _llm(checkpoint, async_output, async_scheduling)
    sampler = llm.engine.sampler
    draw = sampler.draw
    broken = {30: math.nan, 32: math.inf}  # by first prompt token

    def draw_with_broken_rows(logits, seqs):  # as a model whose activations overflowed would give
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.token_ids[0] in broken and seq.num_output_tokens == 2:
                logits[row, 7] = broken[seq.token_ids[0]]
        return draw(logits, seqs)

    sampler.draw = draw_with_broken_rows
    params = PLAIN + [SamplingParams(temperature=1, seed=5, max_tokens=8, ignore_eos=True),
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)]
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [[30, 31], [32, 33]]], params)
    assert _outputs(results[:3]) == expected
    for result in results[3:]:
        out = result.outputs[0]
        assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (2, "abort", None)
    assert len(results[4].outputs[0].logprobs) == 2
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_a_grammar_that_raises_ends_its_request_alone(tiny_checkpoint):
    checkpoint = tiny_checkpoint(arch="llama")
    expected = _alone(checkpoint)
    llm = _llm(checkpoint, True, True)
    engine = llm.engine

    class Exploding:
        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("matcher state corrupted")

    add = engine.add_checked_request

    def add_then_break(request_id, prompt_token_ids, *args, **kwargs):
        add(request_id, prompt_token_ids, *args, **kwargs)
        if prompt_token_ids[0] == 40:
            engine.requests[request_id][0].grammar.matcher = Exploding()

    engine.add_checked_request = add_then_break
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [[40, 41]]],
                           PLAIN + [_regex("[a-z]+", temperature=0, max_tokens=8)])
    assert _outputs(results[:3]) == expected
    out = results[3].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([], "stop")
    assert engine.pool.num_free == engine.pool.num_blocks

