"""A fuzzing harness over the real engine: seeded random batches of requests with random sampling
parameters, grammars, stop strings, logprobs, n and min_tokens, in a pool small enough to
chunk prompts and preempt, mixed with requests that fail
(a grammar whose language is empty or dead-ends, a contradictory schema, logits that turn NaN,
an abort part-way), in each step mode. Whatever the failing requests do, the engine stays up,
every request ends, every block comes back, and each healthy batch-mate's tokens, text, finish
and logprobs equal what the plain engine gives it in a batch of the healthy requests alone.

Healthy requests draw greedily or with a seed (a seeded draw is keyed by seed, index and output
position, so batch-mates cannot shift it), which makes "equal" exact."""

from __future__ import annotations

import json
import math
import random

import pytest

from pagefleet.worker import LLM, SamplingParams, StructuredOutputsParams
from pagefleet.worker.request_check import InvalidRequest

CASES_PER_MODE = 60
MODES = {"sync": (False, False), "async_output": (True, False), "async_scheduling": (True, True)}
WORDS = ["a", "the", " of", "e", "x", "an"]
POISONS = ["empty_language", "dead_end", "contradictory_schema", "nan_logits", "abort"]


def _llm(checkpoint, async_output: bool, async_scheduling: bool) -> LLM:
    # A pool of 8 blocks (tiny llama: 1 KiB a token) and a 64-token budget: prompts are chunked
    # and sequences preempted.
    return LLM(model=str(checkpoint), dtype="float32", device="cpu", enforce_eager=True, kv_cache_bytes=128 << 10,
               max_model_len=128, max_num_seqs=6, max_num_batched_tokens=64, async_output_proc=async_output,
               async_scheduling=async_scheduling)


def _healthy_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.4
    grammar = None
    if rng.random() < 0.25:
        grammar = StructuredOutputsParams(**rng.choice([{"regex": "[a-z]{1,6}( [a-z]{1,6}){0,3}"},
                                                        {"choice": ["yes", "no", "maybe so"]}]))
    return SamplingParams(
        n=1 if greedy else rng.choice([1, 1, 2]),
        temperature=0.0 if greedy else rng.uniform(0.5, 1.5),
        seed=None if greedy else rng.randrange(1 << 30),
        top_k=rng.choice([0, 0, 5, 50]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.3]),
        stop=rng.sample(WORDS, rng.choice([0, 0, 1, 2])), stop_token_ids=rng.sample(range(5, 1000), rng.choice([0, 2])),
        max_tokens=rng.randint(2, 14), min_tokens=rng.choice([0, 0, 2]), ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, None, 0, 3]), structured_outputs=grammar)


def _poison_params(kind: str, rng: random.Random) -> SamplingParams | None:
    """None: refused as it is made (a schema keyword the grammar compiler does not enforce)."""
    spec = {"empty_language": {"regex": "[^\\s\\S]"}, "dead_end": {"regex": "a[^\\s\\S]"},
            "contradictory_schema": {"json": json.dumps({"allOf": [{"type": "string"}, {"type": "integer"}]})}}
    seed = rng.randrange(1 << 30)
    try:
        return SamplingParams(temperature=1.0, seed=seed, logprobs=1, max_tokens=12, ignore_eos=True,
                              structured_outputs=StructuredOutputsParams(**spec[kind]) if kind in spec else None)
    except InvalidRequest:
        return None


def _case(rng: random.Random, case: int) -> list[tuple[str, list[int], SamplingParams]]:
    """(kind, prompt ids, params) for a batch of 2-4 healthy requests and 1-2 failing ones (case
    k has the k-th kind of POISONS, so each mode's cases have them all), shuffled."""
    batch = [("healthy", [rng.randrange(5, 1000) for _ in range(rng.randint(1, 60))], _healthy_params(rng))
             for _ in range(rng.randint(2, 4))]
    kinds = {POISONS[case % len(POISONS)], rng.choice(POISONS)}
    for kind in sorted(kinds):
        batch.append((kind, [rng.randrange(5, 1000) for _ in range(rng.randint(1, 20))], _poison_params(kind, rng)))
    rng.shuffle(batch)
    return batch


def _run(llm: LLM, batch, abort_after: int = 3) -> dict[str, list[tuple]]:
    """Every request of ``batch`` through ``llm.engine`` step by step: its final outputs by request
    id (None: refused at add). Rows of "nan_logits" requests turn NaN at their second output token;
    "abort" requests are aborted after ``abort_after`` steps."""
    engine = llm.engine
    nan_ids = {f"q{i}" for i, (kind, _, _) in enumerate(batch) if kind == "nan_logits"}
    draw = engine.sampler.draw

    def draw_with_nan(logits, seqs):
        if any(s.request_id in nan_ids and s.num_output_tokens == 1 for s in seqs):
            logits = logits.clone()
            for row, s in enumerate(seqs):
                if s.request_id in nan_ids and s.num_output_tokens == 1:
                    logits[row, 11] = math.nan
        return draw(logits, seqs)

    engine.sampler.draw = draw_with_nan
    outputs: dict[str, list | None] = {}
    for i, (_, prompt, params) in enumerate(batch):
        try:
            if params is None:
                raise InvalidRequest("refused as it was made", "structured_outputs")
            engine.add_request(f"q{i}", prompt, params)
            outputs[f"q{i}"] = [[[], "", None, None, None] for _ in range(params.n)]
        except InvalidRequest:
            outputs[f"q{i}"] = None
    steps = 0
    try:
        while engine.has_unfinished():
            deltas = engine.step()
            steps += 1
            if steps == abort_after:
                deltas += [d for i, (kind, _, _) in enumerate(batch) if kind == "abort"
                           for d in [engine.abort_request(f"q{i}")] if d is not None]
            for delta in deltas:
                for part in delta.sequences:
                    out = outputs[delta.request_id][part.index]
                    out[0] += part.token_ids
                    out[1] += part.text
                    out[2:4] = part.finish_reason, part.stop_reason
                    if part.logprobs is not None:
                        out[4] = (out[4] or []) + [(lp.token_id, lp.logprob) for lp in part.logprobs]
    finally:
        engine.sampler.draw = draw
    return {rid: out and [tuple(o) for o in out] for rid, out in outputs.items()}


def _exact(outputs: list[tuple]) -> list[tuple]:
    """Tokens, text, finish, stop reason and the logprobs' token ids of each sequence."""
    return [(*o[:4], o[4] and [t for t, _ in o[4]]) for o in outputs]


def _logprob_values(outputs: list[tuple]) -> list[float]:
    """The logprobs' values: fp32 logits of one row move in their last bits with the batch's
    shape (the matmul's reduction order), so these are held to 1e-5, the rest exactly."""
    return [v for o in outputs for _, v in o[4] or []]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint(arch="llama")


@pytest.fixture(scope="module")
def plain(checkpoint):
    return _llm(checkpoint, False, False)


@pytest.mark.parametrize("mode", MODES)
def test_failing_requests_leave_their_batch_mates_exactly_as_alone(checkpoint, plain, mode):
    llm = _llm(checkpoint, *MODES[mode])
    rng = random.Random(f"fuzz-{mode}")
    for case in range(CASES_PER_MODE):
        batch = _case(rng, case)
        got = _run(llm, batch)
        healthy = [(i, item) for i, item in enumerate(batch) if item[0] == "healthy"]
        alone = _run(plain, [item for _, item in healthy])
        for j, (i, _) in enumerate(healthy):
            assert _exact(got[f"q{i}"]) == _exact(alone[f"q{j}"]), (mode, case, batch[i])
            assert _logprob_values(got[f"q{i}"]) == pytest.approx(_logprob_values(alone[f"q{j}"]), abs=1e-5)
        for i, (kind, _, params) in enumerate(batch):
            out = got[f"q{i}"]
            if out is None:  # refused at add: only a grammar that cannot be enforced may be
                assert kind in ("empty_language", "contradictory_schema"), (mode, case, kind)
                continue
            assert all(o[2] is not None for o in out), (mode, case, kind, out)  # every sequence ended
            if kind == "empty_language":
                assert out == [([], "", "stop", None, [])]
            elif kind == "dead_end":
                assert [o[1:3] for o in out] == [("a", "stop")]
            elif kind == "nan_logits":
                assert [(len(o[0]), o[2]) for o in out] == [(1, "abort")]
            elif kind == "abort":
                assert [o[2] for o in out] == ["abort"]
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks, (mode, case)
        assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.num_preemptions > 0
