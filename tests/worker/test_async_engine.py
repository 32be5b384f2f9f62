"""The threaded engine behind the server: streams, aborts, errors, health."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from pagefleet.worker import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.engine.handoff import HeldDeltas
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                    kv_cache_bytes=16 << 20))
    yield eng
    eng.shutdown()


async def collect(engine, rid, ids, params):
    deltas = []
    async for d in engine.generate(rid, ids, params):
        deltas.append(d)
    return deltas


def test_stream_matches_offline_and_frees_blocks(engine, tiny_checkpoint):
    ids = engine.tokenizer.encode("streaming test prompt")
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    async def main():
        return await asyncio.gather(collect(engine, "a", ids, params), collect(engine, "b", ids[:3], params))

    a, b = asyncio.run(main())
    # At most one chunk per engine step (a consumer that lags gets the steps it missed in one):
    # every chunk carries tokens, and only the last one finishes.
    assert sum(len(d.sequences[0].token_ids) for d in a) == 9 and all(d.sequences[0].token_ids for d in a)
    assert [d.finished for d in a] == [False] * (len(a) - 1) + [True]
    assert a[-1].sequences[0].finish_reason == "length"
    offline = LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=16 << 20)
    want = offline.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert [t for d in a for t in d.sequences[0].token_ids] == want.token_ids
    assert "".join(d.sequences[0].text for d in a) == want.text
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_a_consumer_slower_than_the_engine_gets_what_it_missed_in_one_delta(engine):
    ids = engine.tokenizer.encode("a slow reader")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    async def main():
        gen = engine.generate("slow", ids, params)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the stream sends the request and waits for its first delta
        # This loop now runs nothing (a blocking sleep) while the engine makes all 24 tokens: each
        # step's delta waits in the loop's queue of callbacks, none reaches the stream yet.
        before = engine.stats().generation_tokens_total
        deadline = time.monotonic() + 30
        while not (engine.stats().generation_tokens_total >= before + 24 and engine.stats().num_running == 0):
            assert time.monotonic() < deadline, "the engine did not finish the request"
            time.sleep(0.01)
        time.sleep(0.2)  # the last step's hand-off follows its stats by a few statements
        only = await first
        rest = [d async for d in gen]
        return only, rest

    only, rest = asyncio.run(main())
    assert rest == []  # the one read took the whole request
    seq = only.sequences[0]
    assert len(seq.token_ids) == len(seq.logprobs) == 24
    assert (only.finished, seq.finish_reason, only.num_prompt_tokens) == (True, "length", len(ids))
    with LLM(model=str(engine.model_config.path), dtype="float32", kv_cache_bytes=16 << 20) as offline:
        want = offline.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert (seq.token_ids, seq.text) == (want.token_ids, want.text)


def test_consumer_leaving_aborts_and_frees_blocks(engine):
    ids = engine.tokenizer.encode("abandoned request " * 8)

    async def main():
        gen = engine.generate("gone", ids, SamplingParams(max_tokens=500, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        held = engine.stats()
        assert held.num_running == 1 and held.num_free_blocks < held.num_total_blocks
        await gen.aclose()
        for _ in range(100):  # the engine thread applies the abort before its next step
            await asyncio.sleep(0.01)
            s = engine.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                return s
        return engine.stats()

    s = asyncio.run(main())
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks


def test_forward_takes_every_delta_but_the_last_which_the_stream_yields(engine):
    ids = engine.tokenizer.encode("forwarded prompt")
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    async def main():
        forwarded: list[RequestOutputDelta] = []
        yielded = [d async for d in engine.generate("fwd", ids, params, forward=forwarded.append)]
        return forwarded, yielded

    forwarded, yielded = asyncio.run(main())
    assert len(yielded) == 1 and yielded[0].finished and yielded[0].sequences[0].finish_reason == "length"
    assert forwarded and not any(d.finished for d in forwarded)
    tokens = [t for d in forwarded + yielded for t in d.sequences[0].token_ids]
    want = asyncio.run(collect(engine, "plain", ids, params))
    assert tokens == [t for d in want for t in d.sequences[0].token_ids]
    assert "".join(d.sequences[0].text for d in forwarded + yielded) == "".join(d.sequences[0].text for d in want)


def test_a_forwarding_stream_closed_early_forwards_nothing_more_and_frees_blocks(engine):
    ids = engine.tokenizer.encode("abandoned forwarded request " * 4)

    async def main():
        forwarded: list[RequestOutputDelta] = []
        gen = engine.generate("fwd-gone", ids, SamplingParams(max_tokens=500, ignore_eos=True),
                              forward=forwarded.append)
        pending = asyncio.ensure_future(gen.__anext__())
        while len(forwarded) < 3:
            await asyncio.sleep(0.005)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await gen.aclose()
        at_close = len(forwarded)
        for _ in range(100):  # the engine thread applies the abort before its next step
            await asyncio.sleep(0.01)
            s = engine.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                break
        await asyncio.sleep(0.05)
        return at_close, len(forwarded), engine.stats()

    at_close, at_end, s = asyncio.run(main())
    assert at_end == at_close >= 3
    assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks


def test_bad_input_raises_before_anything_is_queued(engine):
    async def main(ids, params):
        return await collect(engine, "bad", ids, params)

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main([], SamplingParams()))
    with pytest.raises(ValueError, match=r"you requested \d+ tokens \(3 in the prompt"):
        asyncio.run(main([1, 2, 3], SamplingParams(max_tokens=engine.model_config.max_model_len)))
    assert engine.stats().num_waiting == 0
    engine.check_health()


def test_explicit_abort_reports_abort(engine):
    ids = engine.tokenizer.encode("to be aborted")

    async def main():
        deltas = []
        async for d in engine.generate("ab", ids, SamplingParams(max_tokens=1000, ignore_eos=True)):
            deltas.append(d)
            if len(deltas) == 2:
                assert engine.abort("ab") is True
        return deltas

    deltas = asyncio.run(main())
    assert deltas[-1].finished and deltas[-1].sequences[0].finish_reason == "abort"
    assert engine.abort("ab") is False


def test_shutdown_ends_open_streams(tiny_checkpoint):
    from pagefleet.worker.engine.async_engine import EngineDeadError

    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                    kv_cache_bytes=16 << 20))
    ids = eng.tokenizer.encode("shut down mid-stream")

    async def main():
        gen = eng.generate("s", ids, SamplingParams(max_tokens=1500, ignore_eos=True))
        await gen.__anext__()
        eng.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_one_slow_step_is_progress_not_a_stall(tiny_checkpoint):
    """A step longer than the stall limit (a cold compile, a big model on CPU) keeps the engine
    healthy; a step past the step timeout, or work with no step at all, does not."""
    import threading

    from pagefleet.worker.engine.async_engine import EngineDeadError

    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                    kv_cache_bytes=16 << 20), stall_timeout_s=0.3, step_timeout_s=3.0)
    real_step = eng.engine.step
    release = threading.Event()

    def slow_step():
        release.wait(10)
        return real_step()

    eng.engine.step = slow_step
    try:
        async def main():
            gen = eng.generate("slow", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(1.0)  # inside the first step, > 3x the stall limit
            eng.check_health()
            await asyncio.sleep(2.5)  # now past the step timeout
            with pytest.raises(EngineDeadError, match="has run for"):
                eng.check_health()
            release.set()
            await first
            async for _ in gen:
                pass
            eng.check_health()  # healthy again once steps complete

        asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        release.set()
        eng.shutdown()


def test_a_cpu_engine_computes_at_the_lowest_priority_and_nothing_else_does(engine):
    # The engine thread (and the OpenMP team it starts) yields the cores to the serving path's
    # threads; the caller's thread keeps its own priority.
    asyncio.run(collect(engine, "prio", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2)))
    assert os.getpriority(os.PRIO_PROCESS, engine._thread.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19


def test_a_cpu_engine_pins_its_thread_and_openmp_team_one_core_each(engine):
    # As many compute threads as cores (the default): each keeps a core of its own, so two of
    # them never take turns on one core while a step waits at its barrier for both.
    asyncio.run(collect(engine, "pin", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2)))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        assert engine.pinned_threads == {}
        return
    pinned = engine.pinned_threads
    assert pinned[engine._thread.native_id] == cores[0]
    assert sorted(pinned.values()) == cores  # one thread per core, every core
    for tid, core in pinned.items():
        assert os.sched_getaffinity(tid) == {core}
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19  # the engine's own team, not another thread


def test_a_thread_whose_openmp_team_already_exists_is_not_pinned():
    # Only a team started by the pinning call itself is known to be this thread's: a thread that
    # computed before gets nothing pinned (and its own affinity stays every core).
    from pagefleet.worker.cpu.threads import pin_compute_threads

    got: list = []

    def compute_then_pin() -> None:
        torch.ones(torch.get_num_threads() * (1 << 16)).add_(1.0)
        got.append(pin_compute_threads())
        got.append(os.sched_getaffinity(0))

    t = threading.Thread(target=compute_then_pin)
    t.start()
    t.join()
    assert got == [{}, os.sched_getaffinity(0)]


def test_the_engine_is_built_on_its_step_thread_after_that_thread_took_the_lowest_priority(
        tiny_checkpoint, monkeypatch):
    # libgomp keeps a thread pool per thread that starts parallel regions, and with more pooled
    # threads than cores it stops spinning at barriers: an engine built on the caller's thread
    # and stepped on its own had two pools, and every region of every step ended asleep.
    from pagefleet.worker.engine import async_engine

    # The torch thread count it computes with is counted on the process's cores, not on the one
    # core the step thread is pinned to before the build (that would count 1).
    built_on: list = []
    computes_with: list = []

    class Recording(async_engine.LLMEngine):
        def __init__(self, args):
            built_on.append((threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            super().__init__(args)
            computes_with.append(torch.get_num_threads())  # this thread's: the one that steps

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32", device="cpu",
                                    kv_cache_bytes=16 << 20))
    try:
        assert built_on == [(eng._thread.ident, 19)]
        assert computes_with == [len(os.sched_getaffinity(0))]
        assert threading.get_ident() != eng._thread.ident
        out = asyncio.run(collect(eng, "built", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3,
                                                                         ignore_eos=True)))
        assert sum(len(d.sequences[0].token_ids) for d in out) == 3 and out[-1].finished
    finally:
        eng.shutdown()


def _engine_threads_alive_since(before: set) -> list:
    """The engine step threads started since ``before`` (a set of threads) still alive after
    up to 10 s each to end."""
    started = [t for t in threading.enumerate() if t not in before and t.name == "pagefleet-engine"]
    for t in started:
        t.join(timeout=10)
    return [t for t in started if t.is_alive()]


def test_an_engine_that_cannot_be_built_raises_from_the_constructor_and_leaves_no_thread(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(Exception, match=str(tmp_path / "missing")):
        AsyncLLMEngine(EngineArgs(model=str(tmp_path / "missing"), dtype="float32", device="cpu"))
    assert _engine_threads_alive_since(before) == []


def test_a_constructor_that_fails_after_the_build_frees_the_engine_and_ends_its_thread(tiny_checkpoint,
                                                                                       monkeypatch):
    # An interrupt, or a metrics recorder that raises, once the step thread has built the engine:
    # the constructor raises, and the thread shuts the engine down (weights and KV cache freed)
    # instead of waiting forever for a start that never comes.
    from pagefleet.worker.engine import async_engine

    built: list = []

    class Recording(async_engine.LLMEngine):
        def __init__(self, args):
            super().__init__(args)
            built.append(self)

    def failing_recorder(cfg):
        raise RuntimeError("no metrics today")

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="no metrics today"):
        AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32", device="cpu",
                                  kv_cache_bytes=16 << 20), metrics=failing_recorder)
    assert _engine_threads_alive_since(before) == []
    assert len(built) == 1
    with pytest.raises(RuntimeError, match="shut down"):
        built[0].executor.execute(None)


def _delta(rid: str, tokens: list[int], finished: bool = False, text: str = "") -> RequestOutputDelta:
    seq = CompletionOutput(index=0, text=text, token_ids=list(tokens), logprobs=None,
                           finish_reason="length" if finished else None)
    return RequestOutputDelta(rid, [seq], num_prompt_tokens=3, num_cached_tokens=0, finished=finished)


def test_held_deltas_send_the_first_at_once_then_every_n_tokens_and_the_last_at_once():
    hold = HeldDeltas(3)
    out = [hold.release(_delta("a", [t], finished=t == 8, text=str(t))) for t in range(1, 9)]
    sent = [d for d in out if d is not None]
    assert [d.sequences[0].token_ids for d in sent] == [[1], [2, 3, 4], [5, 6, 7], [8]]
    assert [d.sequences[0].text for d in sent] == ["1", "234", "567", "8"]
    assert [d.finished for d in sent] == [False, False, False, True]
    assert len(hold) == 0  # nothing kept once the request finished
    # A step without a token (a prompt chunk) counts nothing; an abort's final delta takes what is held.
    hold.release(_delta("b", [1]))
    assert hold.release(_delta("b", [])) is None and hold.release(_delta("b", [2])) is None
    last = hold.release(_delta("b", [], finished=True))
    assert (last.sequences[0].token_ids, last.finished, len(hold)) == ([2], True, 0)
    # One delta that finishes at once goes out as it is.
    only = _delta("c", [1, 2], finished=True)
    assert hold.release(only) is only and len(hold) == 0


def test_stream_interval_streams_the_same_tokens_in_fewer_deltas(tiny_checkpoint):
    eng = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                    kv_cache_bytes=16 << 20, stream_interval=4))
    try:
        ids = eng.tokenizer.encode("streaming test prompt")
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        deltas = asyncio.run(collect(eng, "a", ids, params))
    finally:
        eng.shutdown()
    sizes = [len(d.sequences[0].token_ids) for d in deltas]
    # The first token alone (time to first token is never held), then at least 4 a delta (a
    # consumer that lags merges more) but for the last.
    assert sizes[0] == 1 and sum(sizes) == 10 and all(n >= 4 for n in sizes[1:-1])
    assert len(deltas) <= 4 and [d.finished for d in deltas][-1]
    with LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=16 << 20) as offline:
        want = offline.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert [t for d in deltas for t in d.sequences[0].token_ids] == want.token_ids
    assert "".join(d.sequences[0].text for d in deltas) == want.text
