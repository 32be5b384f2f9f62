"""async_output_proc, alone and with async_scheduling: a step's outputs finished while the next
step runs, and the next decode step launched before this one's tokens reach the host, give
exactly the tokens, text and finishes of doing each step at once, stop strings included (found
one step late, the extra token dropped), and every block comes back."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.worker import LLM, AsyncLLMEngine, EngineArgs, SamplingParams

PROMPTS = [list(range(10 + i, 14 + 3 * i)) for i in range(5)]
# (async output processing, async scheduling) of the engines held to the plain one.
MODES = [(True, False), (True, True)]


def _llm(checkpoint, async_output: bool, async_scheduling: bool = False, **kwargs) -> LLM:
    kwargs = {"kv_cache_bytes": 4 << 20, "max_num_seqs": 8} | kwargs
    return LLM(model=str(checkpoint), dtype="float32", device="cpu", enforce_eager=True,
               async_output_proc=async_output, async_scheduling=async_scheduling, **kwargs)


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _count_launched_ahead(engine) -> list[int]:
    """Wrap the engine's executor: the returned list's length is the steps launched with the
    previous step's tokens on the device (async scheduling)."""
    ahead: list[int] = []
    execute = engine.executor.execute

    def counted(step, prev_tokens=None):
        if prev_tokens is not None:
            ahead.append(len(step.seq_lens))
        return execute(step, prev_tokens)

    engine.executor.execute = counted
    return ahead


def _both(checkpoint, params, **kwargs):
    """The outputs of the plain engine, which each of MODES matches; the preemptions of each
    engine, the plain one's first."""
    plain = _llm(checkpoint, False, **kwargs)
    expected = _run(plain, params)
    preemptions = [plain.engine.scheduler.num_preemptions]
    for async_output, async_scheduling in MODES:
        llm = _llm(checkpoint, async_output, async_scheduling, **kwargs)
        assert (llm.engine.async_output, llm.engine.async_scheduling) == (async_output, async_scheduling)
        ahead = _count_launched_ahead(llm.engine)
        assert _run(llm, params) == expected, (async_output, async_scheduling)
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
        assert bool(ahead) == async_scheduling
        preemptions.append(llm.engine.scheduler.num_preemptions)
    return expected, preemptions


def test_lengths_and_stop_ids(tiny_checkpoint):
    free = _run(_llm(tiny_checkpoint("llama"), False), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    stop_ids = sorted({seqs[0][0][4] for seqs in free})
    out, _ = _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                         stop_token_ids=stop_ids))
    assert all(seqs[0][2] == "stop" and len(seqs[0][0]) <= 5 for seqs in out)


def test_stop_strings_found_a_step_late_drop_the_extra_token(tiny_checkpoint):
    free = _run(_llm(tiny_checkpoint("llama"), False), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # A piece of each sequence's text from its middle: the stop string ends it there.
    stops = [seqs[0][1][len(seqs[0][1]) // 2:len(seqs[0][1]) // 2 + 3] for seqs in free]
    stops = [s for s in stops if s.strip()]
    assert stops
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stops)
    out, _ = _both(tiny_checkpoint("llama"), params)
    assert any(seqs[0][2] == "stop" and seqs[0][3] in stops for seqs in out)


@pytest.mark.parametrize("n", [1, 3])
def test_random_sampling_with_seeds_and_n(tiny_checkpoint, n):
    _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, n=n, seed=3,
                                                   ignore_eos=True, logprobs=2))


def test_an_abort_between_steps_reports_the_last_tokens_text(tiny_checkpoint):
    def run(async_output: bool, async_scheduling: bool = False):
        engine = _llm(tiny_checkpoint("llama"), async_output, async_scheduling).engine
        engine.add_request("a", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        engine.add_request("b", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        got: dict[str, list] = {"a": [], "b": []}
        for _ in range(4):
            for d in engine.step():
                got[d.request_id] += [(s.token_ids, s.text) for s in d.sequences]
        final = engine.abort_request("a")
        got["a"] += [(s.token_ids, s.text, s.finish_reason) for s in final.sequences]
        while engine.has_unfinished():
            for d in engine.step():
                got[d.request_id] += [(s.token_ids, s.text) for s in d.sequences]
        assert engine.pool.num_free == engine.pool.num_blocks
        joined = {rid: ([t for part in parts for t in part[0]], "".join(part[1] for part in parts))
                  for rid, parts in got.items()}
        return joined, got["a"][-1][2]

    plain, plain_reason = run(False)
    assert plain_reason == "abort"
    for mode in MODES:
        assert run(*mode) == (plain, "abort"), mode
    assert len(plain["a"][0]) == 4 and len(plain["b"][0]) == 20


def test_penalties_min_tokens_and_a_grammar_see_every_earlier_token(tiny_checkpoint):
    """What sampling a step reads on the host (penalty counts, min_tokens, the grammar's state)
    includes the token of the step before, though that step was launched before the host had it."""
    from pagefleet.worker.sampling_params import StructuredOutputsParams

    free = _run(_llm(tiny_checkpoint("llama"), False), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stop_ids = sorted({seqs[0][0][1] for seqs in free})  # a stop id each sequence draws early on
    out, _ = _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.7, seed=5, max_tokens=10, min_tokens=4,
                                                         repetition_penalty=1.3, presence_penalty=0.5,
                                                         frequency_penalty=0.4, stop_token_ids=stop_ids))
    assert all(len(seqs[0][0]) >= 4 for seqs in out)
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma", "delta epsilon zeta"])
    out, _ = _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.9, seed=1, max_tokens=30,
                                                         structured_outputs=choice))
    assert all(seqs[0][1] in choice.choice for seqs in out)


@pytest.mark.parametrize("limits", [{"max_num_seqs": 2}, {"kv_cache_bytes": 160 << 10, "max_model_len": 128},
                                    {"max_num_seqs": 4, "max_num_batched_tokens": 8}],
                         ids=["requests-waiting", "pool-short", "prompts-chunked"])
def test_admissions_and_a_short_pool_interleave_with_launches_ahead(tiny_checkpoint, limits):
    """Requests waiting for a seat stop launches ahead until the scheduler has admitted them; a
    pool short of a block for the next step stops them too, and the scheduler preempts as ever."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, preemptions = _both(tiny_checkpoint("llama"), params, **limits)
    # 10 blocks of 16 tokens for 5 sequences of up to 40: one is preempted, in every mode.
    assert preemptions == ([1, 1, 1] if "kv_cache_bytes" in limits else [0, 0, 0])


def test_a_request_arriving_while_steps_launch_ahead_joins_the_next_launch(tiny_checkpoint):
    engine = _llm(tiny_checkpoint("llama"), True, async_scheduling=True).engine
    ahead = _count_launched_ahead(engine)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    for _ in range(4):
        engine.step()
    assert ahead == [1] * 4  # a's prompt step launched its next; so did each decode step
    engine.add_request("b", PROMPTS[1], params)
    # The step launched before b arrived runs, and the step launched behind it holds b's
    # prompt beside a's next token: b waits for no scheduler round of its own.
    assert not any(d.request_id == "b" for d in engine.step()) and ahead == [1] * 4 + [2]
    assert not any(d.request_id == "b" for d in engine.step()) and ahead == [1] * 4 + [2, 2]
    # b's first token, sampled in the call before, is handed on in this one (async output).
    deltas = engine.step()
    expected = _run(_llm(tiny_checkpoint("llama"), False), params)[1][0][0]
    assert [d.sequences[0].token_ids for d in deltas if d.request_id == "b"] == [expected[:1]]
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_async_scheduling_launches_the_next_step_before_the_host_has_this_ones_tokens(tiny_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = _run(_llm(tiny_checkpoint("llama"), False), params)
    llm = _llm(tiny_checkpoint("llama"), True, async_scheduling=True)
    engine = llm.engine
    events: list[str] = []
    execute, draw, collect = engine.executor.execute, engine.sampler.draw, engine.sampler.collect

    def traced_execute(step, prev_tokens=None):
        events.append("execute" if prev_tokens is None else "execute ahead")
        return execute(step, prev_tokens)

    def traced_draw(logits, seqs):
        events.append("draw")
        return draw(logits, seqs)

    def traced_collect(drawn, seqs):
        events.append("collect")
        return collect(drawn, seqs)

    engine.executor.execute, engine.sampler.draw, engine.sampler.collect = traced_execute, traced_draw, traced_collect
    assert _run(llm, params) == plain
    # The prompts' step is scheduled; each of the next 8 is launched while the host has yet to
    # collect the tokens of the step before it; the 9th tokens end every sequence by length.
    assert events == ["execute", "draw", "execute ahead", "collect"] + ["draw", "execute ahead", "collect"] * 7 + [
        "draw", "collect"]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_previous_steps_deltas_are_handed_on_while_the_next_step_runs(tiny_checkpoint):
    """With ``on_early_outputs`` (as the served engine sets it) a step's deltas leave between the
    next step's launch and its sampling, not when that step returns; step() then returns only
    what ends with its own step. Together they are exactly the tokens and text of finishing
    every step at once."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = _run(_llm(tiny_checkpoint("llama"), False), params)
    engine = _llm(tiny_checkpoint("llama"), True, async_scheduling=False).engine
    events: list[tuple] = []
    execute, draw = engine.executor.execute, engine.sampler.draw

    def traced_execute(step, prev_tokens=None):
        events.append(("execute",))
        return execute(step, prev_tokens)

    def traced_draw(logits, seqs):
        events.append(("sample",))
        return draw(logits, seqs)

    engine.executor.execute, engine.sampler.draw = traced_execute, traced_draw
    engine.on_early_outputs = lambda deltas: events.append(("early", deltas))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        events.append(("returned", engine.step()))
    got: dict[str, list] = {str(i): [[], ""] for i in range(len(PROMPTS))}
    for event in events:
        for delta in event[1] if event[0] in ("early", "returned") else ():
            got[delta.request_id][0] += delta.sequences[0].token_ids
            got[delta.request_id][1] += delta.sequences[0].text
    assert [(tuple(got[str(i)][0]), got[str(i)][1]) for i in range(len(PROMPTS))] == [
        (tuple(seqs[0][0]), seqs[0][1]) for seqs in plain]
    names = [e[0] for e in events]
    early_at = [i for i, name in enumerate(names) if name == "early"]
    assert len(early_at) == 8  # steps 2-9 each hand on the step before theirs; the 9th tokens end at once
    assert all(names[i - 1] == "execute" and names[i + 1] == "sample" for i in early_at)
    returned = [d for e in events if e[0] == "returned" for d in e[1]]
    assert {d.request_id for d in returned} == {str(i) for i in range(len(PROMPTS))}
    assert all(d.finished and len(d.sequences[0].token_ids) == 1 for d in returned)
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_served_engine_with_async_output_streams_the_same_tokens(tiny_checkpoint, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = _run(_llm(tiny_checkpoint("llama"), False), params)
    engine = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                                       kv_cache_bytes=4 << 20, max_num_seqs=8, enforce_eager=True,
                                       async_output_proc=True, async_scheduling=async_scheduling))

    async def one(i: int):
        deltas = [d async for d in engine.generate(str(i), PROMPTS[i], params)]
        tokens = tuple(t for d in deltas for t in d.sequences[0].token_ids)
        return tokens, "".join(d.sequences[0].text for d in deltas), deltas[-1].sequences[0].finish_reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        assert (engine.engine.async_output, engine.engine.async_scheduling) == (True, async_scheduling)
        assert asyncio.run(main()) == [(tuple(seqs[0][0]), seqs[0][1], seqs[0][2]) for seqs in plain]
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()


def test_async_scheduling_asked_for_where_it_cannot_run_is_refused_at_start(tiny_checkpoint):
    with pytest.raises(ValueError, match="async_scheduling needs async output processing"):
        _llm(tiny_checkpoint("llama"), False, async_scheduling=True)
    with pytest.raises(ValueError, match="num_scheduler_steps 1"):
        _llm(tiny_checkpoint("llama"), True, async_scheduling=True, num_scheduler_steps=4)
    # By default it follows async output processing on a one-rank engine.
    assert _llm(tiny_checkpoint("llama"), True, async_scheduling=None).engine.async_scheduling
    windows = _llm(tiny_checkpoint("llama"), True, async_scheduling=None, num_scheduler_steps=4)
    assert not windows.engine.async_scheduling
