"""Prompt logprobs (vLLM's prompt_logprobs) equal transformers' log_softmax over the prompt: each
prompt token's logprob given the tokens before it, and the top ones at its position, whole or in
chunks, beside other requests, after the same prompt is in the prefix cache (it is computed
again, not read), with preemption, and with max_tokens 0 (the prompt alone)."""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams

from hf_reference import hf_model

K = 3


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint(arch="llama"))


def _reference(checkpoint, prompt):
    with torch.no_grad():
        logprobs = hf_model(checkpoint)(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
    return [(prompt[j + 1], float(logprobs[j, prompt[j + 1]]), logprobs[j].topk(K).indices.tolist())
            for j in range(len(prompt) - 1)]


def _check(out, checkpoint, prompt):
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    want = _reference(checkpoint, prompt)
    assert [(e.token_id, [t for t, _ in e.top]) for e in got[1:]] == [(t, top) for t, _, top in want]
    assert [e.logprob for e in got[1:]] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_transformers(checkpoint, chunk):
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_bytes=8 << 20, enforce_eager=True, **kwargs)
    prompts = [list(range(5, 45)), [7, 8, 9], list(range(100, 121))]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K),
              SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=K)]
    for _ in range(2):  # the second time every prompt is in the prefix cache: scored all the same
        a, b, c = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _check(a, checkpoint, prompts[0])
        _check(c, checkpoint, prompts[2])
        assert b.prompt_logprobs is None
        assert (c.outputs[0].token_ids, c.outputs[0].finish_reason) == ([], "length")
        assert len(a.outputs[0].token_ids) == 3
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_with_preemption_and_async_scheduling(checkpoint, async_scheduling):
    # 8 blocks of 16 tokens for 4 prompts of 30 and 12 tokens of output each: sequences are
    # preempted and their prompts computed (and scored) again; waiting requests join the steps
    # launched ahead under async scheduling.
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_bytes=128 << 10, max_model_len=128, enforce_eager=True,
              async_output_proc=async_scheduling, async_scheduling=async_scheduling, max_num_batched_tokens=32)
    prompts = [list(range(10 + 40 * i, 40 + 40 * i)) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=K))
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        _check(out, checkpoint, prompt)
        assert len(out.outputs[0].token_ids) == 12
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
