"""The engine thread's metrics and stats line: exact counts from real steps, no Ray (a recording recorder)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import pytest

from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams
from pagefleet.worker.metrics.collector import EngineMetricsBatch
from pagefleet.worker.metrics.engine_metrics import EngineMetrics
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.metrics.stats_log import StatsLogger, stats_line


class Recorder:
    def __init__(self):
        self.batches: list[EngineMetricsBatch] = []

    def record(self, batch):
        self.batches.append(batch)

    def total(self, field):
        values = [getattr(b, field) for b in self.batches]
        return sum(values, []) if isinstance(values[0], list) else sum(values)

    def finished(self):
        out = {}
        for b in self.batches:
            for reason, n in b.finished.items():
                out[reason] = out.get(reason, 0) + n
        return out


async def _run(engine, rid, ids, params):
    deltas = [d async for d in engine.generate(rid, ids, params)]
    return deltas


@pytest.mark.parametrize("async_output", [False, True])
def test_recorded_batches_match_what_the_requests_got(tiny_checkpoint, async_output):
    """The same counts whether a step's deltas go out with it or while the next step runs (and
    then, by default, with each decode step launched ahead: async scheduling)."""
    recorder = Recorder()
    models = []

    def make(cfg):
        models.append((cfg.served_model_name, cfg.max_model_len))
        return recorder

    engine = AsyncLLMEngine(EngineArgs(model=str(tiny_checkpoint(arch="llama")), dtype="float32",
                                       kv_cache_bytes=16 << 20, async_output_proc=async_output), metrics=make)
    try:
        assert engine.engine.async_output is async_output
        ids = engine.tokenizer.encode("metrics test prompt")
        jobs = [("a", ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
                ("b", ids[:4], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2)),
                ("c", ids * 2, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]

        async def main():
            return await asyncio.gather(*(_run(engine, *job) for job in jobs))

        results = asyncio.run(main())
        deadline = time.monotonic() + 10
        while not recorder.batches or len(recorder.total("e2e")) < 3:  # flushed within ~1 s of idle
            assert time.monotonic() < deadline, "no flush after the requests finished"
            time.sleep(0.2)
    finally:
        engine.shutdown()
    generated = sum(len(s.token_ids) for deltas in results for d in deltas for s in d.sequences)
    assert generated == 5 + 2 * 3 + 4
    assert recorder.total("generation_tokens") == generated
    assert recorder.total("prompt_tokens") == len(ids) + 4 + 2 * len(ids)
    assert recorder.finished() == {"length": 4}  # a, b's two sequences, c
    assert len(recorder.total("ttft")) == 3 and len(recorder.total("queue_time")) == 3
    # One per request per step that gave it tokens, after its first such step. A step gives each
    # running sequence one token: a's 5 tokens come in 5 steps, c's 4 in 4; b's second sequence
    # is scheduled the step after its parent's prompt is computed (it shares those blocks), so
    # b's 3 + 3 tokens come in 4 steps. (Counted from the deltas the consumer read this would
    # depend on its pace: one that lags gets several steps in one delta.)
    per_seq = [Counter() for _ in results]  # tokens of each sequence, by its index
    for counts, deltas in zip(per_seq, results):
        for d in deltas:
            for s in d.sequences:
                counts[s.index] += len(s.token_ids)
    assert [dict(c) for c in per_seq] == [{0: 5}, {0: 3, 1: 3}, {0: 4}]
    assert len(recorder.total("itl")) == (5 - 1) + (4 - 1) + (4 - 1)
    assert sorted(recorder.total("request_generation_tokens")) == [4, 5, 6]
    assert sorted(recorder.total("request_prompt_tokens")) == sorted([len(ids), 4, 2 * len(ids)])
    assert all(t >= 0 for t in recorder.total("ttft") + recorder.total("e2e") + recorder.total("queue_time"))
    assert recorder.batches[-1].num_running == 0 and recorder.batches[-1].kv_cache_usage == 0.0
    assert models and models[0][1] > 0


def _stats(steps=0, prompt=0, gen=0, running=0, waiting=0, free=100, queries=0, hits=0):
    return EngineStats(num_total_blocks=100, num_free_blocks=free, num_running=running, num_waiting=waiting,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0, num_steps=steps,
                       prompt_tokens_total=prompt, generation_tokens_total=gen)


def test_stats_line_like_vllms():
    line = stats_line(_stats(), _stats(steps=9, prompt=200, gen=50, running=3, waiting=1, free=75, queries=100,
                                       hits=40), elapsed_s=10.0)
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
                    "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")


def test_stats_logger_speaks_every_interval_while_busy_only():
    log = StatsLogger(5.0, _stats(), now=0.0)
    assert log.due(_stats(steps=3, gen=3, running=1), now=4.9) is None
    assert "Running: 1 reqs" in log.due(_stats(steps=3, gen=3, running=1), now=5.0)
    assert "Avg generation throughput: 0.6 tokens/s" in log.due(_stats(steps=6, gen=6), now=10.0)  # finished since
    assert log.due(_stats(steps=6, gen=6), now=15.0) is None  # idle, nothing done: silent


def test_engine_metrics_logs_the_stats_line(caplog):
    metrics = EngineMetrics(_stats(), 0.0, log_interval_s=2.0)
    with caplog.at_level(logging.INFO, logger="pagefleet.engine"):
        metrics.after_step(0.5, 1.0, _stats(steps=1, gen=1, running=1), [])
        metrics.after_step(1.5, 2.5, _stats(steps=2, gen=2, running=1), [])
    assert [r.getMessage().split(",")[1].strip() for r in caplog.records] == ["Avg generation throughput: 0.8 tokens/s"]


def test_start_up_logs_weight_loading_and_the_kv_pool(tiny_checkpoint, caplog, capsys):
    from pagefleet.worker import LLM

    with caplog.at_level(logging.INFO, logger="pagefleet"):
        llm = LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=2 << 20,
                  max_model_len=256)
        llm.shutdown()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("loaded the weights of llama") for m in messages), messages
    # 2 MiB / 16 KiB per block (2 layers x K,V x 16 tokens x 2 heads x 32 dims x fp32) = 128 blocks
    assert any("KV cache (per rank) of 128 blocks = 2048 tokens (2.0 MiB); maximum concurrency at max_model_len "
               "256: 8.00x" in m for m in messages), messages
    assert "Loading safetensors checkpoint shards: 100%" in capsys.readouterr().err


def test_a_failing_recorder_never_stops_the_engine_loop(caplog):
    class Broken:
        calls = 0

        def record(self, batch):
            Broken.calls += 1
            raise RuntimeError("exporter down")

    metrics = EngineMetrics(_stats(), 0.0, recorder=Broken(), flush_interval_s=1.0)
    with caplog.at_level(logging.ERROR, logger="pagefleet.engine"):
        for t in (1.0, 2.0, 3.0):
            metrics.after_step(t - 0.5, t, _stats(steps=int(t), gen=int(t), running=1), [])
    assert Broken.calls == 3
    assert len([r for r in caplog.records if "recording engine metrics failed" in r.getMessage()]) == 1
