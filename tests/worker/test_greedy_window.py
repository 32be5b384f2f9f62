"""--num-scheduler-steps: greedy decode windows (several steps in one go, each fed the previous
one's tokens on the device) give exactly the tokens, text and finishes of one step at a time."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams

PROMPTS = [list(range(10 + i, 14 + 3 * i)) for i in range(5)]


def _llm(checkpoint, steps: int, static: bool = True, **kw) -> LLM:
    llm = LLM(model=str(checkpoint), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_num_seqs=8,
              enforce_eager=True, num_scheduler_steps=steps, **kw)
    if static:
        llm.engine.executor.runner.use_graphs(capture=False)  # the static buffers CUDA graphs run over
    return llm


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("max_tokens", [1, 7, 12])
def test_a_window_of_four_generates_what_single_steps_do(tiny_checkpoint, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    single = _llm(tiny_checkpoint("llama"), 1)
    windowed = _llm(tiny_checkpoint("llama"), 4)
    expected = _run(single, params)
    assert _run(windowed, params) == expected
    assert all(len(t) == max_tokens and reason == "length" for t, _, reason in expected)
    # The prefill step samples the first token; the rest come in windows of 4 device steps, the
    # last window computing past max_tokens for nothing.
    assert single.engine.num_steps == max_tokens
    assert windowed.engine.num_steps == 1 + 4 * -(-(max_tokens - 1) // 4)
    assert windowed.engine.pool.num_free == single.engine.pool.num_free == windowed.engine.pool.num_blocks


def test_stops_inside_a_window_drop_the_rest_of_its_tokens(tiny_checkpoint):
    probe = _llm(tiny_checkpoint("llama"), 1)
    free_run = _run(probe, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # Stop each sequence on the token it would produce 3rd (a stop token id) or on text it emits.
    stop_ids = sorted({ids[2] for ids, _, _ in free_run})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=stop_ids)
    expected = _run(_llm(tiny_checkpoint("llama"), 1), params)
    windowed = _llm(tiny_checkpoint("llama"), 8)
    assert _run(windowed, params) == expected
    assert all(reason == "stop" and len(ids) <= 3 for ids, _, reason in expected)
    assert windowed.engine.pool.num_free == windowed.engine.pool.num_blocks  # the window's extra blocks came back


def test_rounds_that_sample_on_the_host_run_step_by_step(tiny_checkpoint):
    windowed = _llm(tiny_checkpoint("llama"), 4)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    windowed.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, params)
    assert windowed.engine.num_steps == 6  # one prefill + five decode steps: no window
    plain = _llm(tiny_checkpoint("llama"), 4, static=False)  # no static buffers: no window either
    plain.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert plain.engine.num_steps == 6


def test_num_scheduler_steps_must_be_positive():
    from pagefleet.worker.engine_args import EngineArgs

    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer >= 1"):
        EngineArgs(num_scheduler_steps=0)
