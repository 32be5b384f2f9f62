"""async_output_proc: a step's outputs finished while the next step runs give exactly the tokens,
text and finishes of finishing them at once, stop strings included (found one step late, the
extra token dropped), and every block comes back."""

from __future__ import annotations

import pytest

from pagefleet.worker import LLM, SamplingParams

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
