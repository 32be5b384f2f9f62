"""async_output_proc: a step's outputs finished while the next step runs give exactly the tokens,
text and finishes of finishing them at once, stop strings included (found one step late, the
extra token dropped), and every block comes back."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.worker import LLM, AsyncLLMEngine, EngineArgs, SamplingParams

PROMPTS = [list(range(10 + i, 14 + 3 * i)) for i in range(5)]


def _llm(checkpoint, async_output: bool) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_num_seqs=8,
               enforce_eager=True, async_output_proc=async_output)


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _both(checkpoint, params):
    plain, deferred = _llm(checkpoint, False), _llm(checkpoint, True)
    assert (plain.engine.async_output, deferred.engine.async_output) == (False, True)
    expected = _run(plain, params)
    assert _run(deferred, params) == expected
    assert deferred.engine.pool.num_free == deferred.engine.pool.num_blocks
    return expected


def test_lengths_and_stop_ids(tiny_checkpoint):
    free = _run(_llm(tiny_checkpoint("llama"), False), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    stop_ids = sorted({seqs[0][0][4] for seqs in free})
    out = _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                         stop_token_ids=stop_ids))
    assert all(seqs[0][2] == "stop" and len(seqs[0][0]) <= 5 for seqs in out)


def test_stop_strings_found_a_step_late_drop_the_extra_token(tiny_checkpoint):
    free = _run(_llm(tiny_checkpoint("llama"), False), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # A piece of each sequence's text from its middle: the stop string ends it there.
    stops = [seqs[0][1][len(seqs[0][1]) // 2:len(seqs[0][1]) // 2 + 3] for seqs in free]
    stops = [s for s in stops if s.strip()]
    assert stops
    out = _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stops))
    assert any(seqs[0][2] == "stop" and seqs[0][3] in stops for seqs in out)


@pytest.mark.parametrize("n", [1, 3])
def test_random_sampling_with_seeds_and_n(tiny_checkpoint, n):
    _both(tiny_checkpoint("llama"), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, n=n, seed=3,
                                                   ignore_eos=True, logprobs=2))


def test_an_abort_between_steps_reports_the_last_tokens_text(tiny_checkpoint):
    def run(async_output: bool):
        engine = _llm(tiny_checkpoint("llama"), async_output).engine
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
    deferred, deferred_reason = run(True)
    assert plain_reason == deferred_reason == "abort"
    assert deferred == plain
    assert len(plain["a"][0]) == 4 and len(plain["b"][0]) == 20


def test_the_previous_steps_deltas_are_handed_on_while_the_next_step_runs(tiny_checkpoint):
    """With ``on_early_outputs`` (as the served engine sets it) a step's deltas leave between the
    next step's launch and its sampling, not when that step returns; step() then returns only
    what ends with its own step. Together they are exactly the tokens and text of finishing
    every step at once."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = _run(_llm(tiny_checkpoint("llama"), False), params)
    engine = _llm(tiny_checkpoint("llama"), True).engine
    events: list[tuple] = []
    execute, sampler = engine.executor.execute, engine.sampler

    def traced_execute(step):
        events.append(("execute",))
        return execute(step)

    def traced_sampler(logits, seqs):
        events.append(("sample",))
        return sampler(logits, seqs)

    engine.executor.execute, engine.sampler = traced_execute, traced_sampler
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


def test_a_served_engine_with_async_output_streams_the_same_tokens(tiny_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = _run(_llm(tiny_checkpoint("llama"), False), params)
    engine = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu",
                                       kv_cache_bytes=4 << 20, max_num_seqs=8, enforce_eager=True,
                                       async_output_proc=True))

    async def one(i: int):
        deltas = [d async for d in engine.generate(str(i), PROMPTS[i], params)]
        tokens = tuple(t for d in deltas for t in d.sequences[0].token_ids)
        return tokens, "".join(d.sequences[0].text for d in deltas), deltas[-1].sequences[0].finish_reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        assert engine.engine.async_output
        assert asyncio.run(main()) == [(tuple(seqs[0][0]), seqs[0][1], seqs[0][2]) for seqs in plain]
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()
