"""The simulated GPU engine (``EngineArgs.simulate``): the real engine, a step waiting the plan's
roofline time for its batch, the plan's block pool, real KV events, drawn tokens that keep the
sampling parameters' rules, and idle engines that cost no CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from pagefleet.cluster.plan.capacity import Lengths, PlanInputs, make_plan
from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.kv_index import routing_keys
from pagefleet.worker import AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from pagefleet.worker.core.block_hash import pack_hashes
from pagefleet.worker.engine.llm import LLM
from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.model_executor.simulated_runner import SimulatedModelRunner
from pagefleet.worker.sample.seeding import draw_key
from pagefleet.worker.simulated.presets import GPUS, find_model

# Llama-3-8B's published shape, as tests/cluster/test_plan.py counts it.
WEIGHTS = 2 * 8_030_261_248 - 2 * 128256 * 4096  # bf16, all but the embedding table
MATMUL = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2
ATTENTION_PER_KEY = 4 * 32 * 128 * 32
H200 = GPUS["h200"]


def roofline_s(tokens: int, context: int, keys: int) -> float:
    return max((WEIGHTS + context * KV_PER_TOKEN) / H200.bandwidth,
               (2 * MATMUL * tokens + ATTENTION_PER_KEY * keys) / H200.flops)


def step_of(chunks: list[tuple[int, int]]) -> StepInput:
    """A StepInput whose sequences compute positions [start, end) each (only the fields timed)."""
    starts = [0]
    for start, end in chunks:
        starts.append(starts[-1] + end - start)
    return StepInput([], [], [], [], starts, [end for _, end in chunks], [])


@pytest.fixture(scope="module")
def llama_8b_h200():
    """A simulated Llama-3-8B on an H200 (its config-only checkpoint is written on first use)."""
    engine = LLMEngine(EngineArgs(model="llama-3-8b", simulate="h200"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny_args(tiny_checkpoint):
    # A small pool: 4 MiB of fp32 tiny-Llama KV (16 KiB a block) is 256 blocks.
    return EngineArgs(model=str(tiny_checkpoint("llama")), simulate="h200", kv_cache_bytes=4 << 20)


def test_the_pool_is_the_plans_56808_blocks_for_llama_3_8b_on_an_h200(llama_8b_h200):
    m = find_model("llama-3-8b")
    plan = make_plan(PlanInputs(model=m, gpu=H200, num_gpus=1, tensor_parallel_size=1, dtype="bfloat16",
                                kv_cache_dtype="bfloat16", gpu_memory_utilization=0.9, kv_cache_bytes=None,
                                max_model_len=8192, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                                lengths=Lengths(1024, 128)))
    assert llama_8b_h200.pool.num_blocks == plan.num_blocks == 56_808
    assert llama_8b_h200.model_config.served_model_name == "llama-3-8b"
    assert llama_8b_h200.model_config.vocab_size == 128256 and len(llama_8b_h200.tokenizer) == 32000


def test_a_steps_time_is_the_roofline_of_its_batch(llama_8b_h200):
    runner: SimulatedModelRunner = llama_8b_h200.executor.runner
    decode = [(9, 10), (19, 20), (29, 30)]  # three sequences decoding at 10, 20 and 30 tokens
    assert runner.step_seconds(step_of(decode)) == roofline_s(3, 60, 60)
    prefill = [(0, 1000)]  # compute-bound: each prompt token attends to itself and those before
    assert runner.step_seconds(step_of(prefill)) == roofline_s(1000, 1000, 1000 * 1001 // 2)
    assert roofline_s(1000, 1000, 1000 * 1001 // 2) == (2 * MATMUL * 1000 + ATTENTION_PER_KEY * 500500) / H200.flops
    mixed = [(32, 48), (99, 100)]  # 16 prompt tokens after a 32-token prefix hit, beside a decode
    assert runner.step_seconds(step_of(mixed)) == roofline_s(17, 148, sum(range(33, 49)) + 100)


def test_a_decode_step_takes_what_pagefleet_plan_prints(llama_8b_h200):
    m = find_model("llama-3-8b")
    plan = make_plan(PlanInputs(model=m, gpu=H200, num_gpus=1, tensor_parallel_size=1, dtype="bfloat16",
                                kv_cache_dtype="bfloat16", gpu_memory_utilization=0.9, kv_cache_bytes=None,
                                max_model_len=8192, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                                lengths=Lengths(1024, 128)))
    runner = llama_8b_h200.executor.runner
    context = 1024 + 64  # the plan's mean context
    for row in plan.decode:
        assert runner.step_seconds(step_of([(context - 1, context)] * row.batch)) * 1e3 == row.ms


def test_a_moe_step_reads_the_experts_its_batch_routes_to():
    """A simulated Qwen3-30B-A3B on an H100: each decode step takes what ``pagefleet plan`` prints,
    whose bytes grow with the experts the batch reads (8 a token, at most 128 a layer)."""
    engine = LLMEngine(EngineArgs(model="qwen3-30b-a3b", simulate="h100", max_model_len=8192))
    try:
        cfg = engine.model_config
        assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("Qwen3MoeForCausalLM", 128, 8)
        assert (cfg.num_parameters, cfg.active_parameters_per_token) == (30_532_122_624, 3_353_032_704)
        plan = make_plan(PlanInputs(model=find_model("qwen3-30b-a3b"), gpu=GPUS["h100"], num_gpus=1,
                                    tensor_parallel_size=1, dtype="bfloat16", kv_cache_dtype="bfloat16",
                                    gpu_memory_utilization=0.9, kv_cache_bytes=None, max_model_len=8192,
                                    block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                                    lengths=Lengths(1024, 128)))
        assert engine.pool.num_blocks == plan.num_blocks
        runner, context = engine.executor.runner, 1024 + 64
        assert [row.experts_read for row in plan.decode] == [8, 16, 32, 64, 128, 128, 128]
        for row in plan.decode:
            assert runner.step_seconds(step_of([(context - 1, context)] * row.batch)) * 1e3 == row.ms
        # one expert in all 48 layers: gate, up and down of 2048 x 768, in bf16
        expert = 48 * 3 * 2048 * 768 * 2
        one, two = (runner.step_seconds(step_of([(context - 1, context)] * b)) for b in (1, 2))
        kv = 2 * 48 * 4 * 128 * 2 * context
        assert (two - one) * GPUS["h100"].bandwidth == pytest.approx(8 * expert + kv, rel=1e-9)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_engine_step_waits_at_least_its_time_over_the_efficiency(async_scheduling):
    """Step by step; with async scheduling a step is launched during the call before the one
    that waits for it, so only the steps' sum is bounded."""
    engine = LLMEngine(EngineArgs(model="llama-3-8b", simulate="h200", simulate_efficiency=0.1,
                                  async_scheduling=async_scheduling))
    runner = engine.executor.runner
    timed = []
    step_seconds = runner.step_seconds
    runner.step_seconds = lambda step: timed.append(step_seconds(step)) or timed[-1]
    try:
        engine.add_request("a", list(range(100, 400)), SamplingParams(max_tokens=4, ignore_eos=True))
        engine.add_request("b", list(range(500, 540)), SamplingParams(max_tokens=4, ignore_eos=True))
        walls = []
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
    finally:
        engine.shutdown()
    assert len(walls) == len(timed) == 4  # one prefill of both prompts, three decodes
    assert timed[0] == roofline_s(340, 340, 300 * 301 // 2 + 40 * 41 // 2) / 0.1
    assert timed[1] == roofline_s(2, 301 + 41, 301 + 41) / 0.1
    if async_scheduling:
        assert sum(walls) >= sum(timed), (walls, timed)
    else:
        assert all(wall >= t for wall, t in zip(walls, timed)), (walls, timed)


def test_tokens_keep_the_sampling_rules(tiny_args):
    llm = LLM(**{f: getattr(tiny_args, f) for f in ("model", "simulate", "kv_cache_bytes")})
    try:
        engine = llm.engine
        eos = engine.model_config.eos_token_ids
        vocab = len(llm.tokenizer)
        prompt = {"prompt_token_ids": list(range(10, 30))}

        def gen(**params):
            return llm.generate(prompt, SamplingParams(**params))[0].outputs

        # max_tokens with ignore_eos: exactly that many, finishing on length
        (out,) = gen(max_tokens=37, ignore_eos=True, seed=1)
        assert len(out.token_ids) == 37 and out.finish_reason == "length"
        # seeded: the token at output position k is key(seed, index, k) over the tokenizer's ids
        assert out.token_ids == [draw_key(1, 0, k) % vocab for k in range(37)]
        # n: each sequence its own seeded stream; the same request again gives the same outputs
        outs = gen(max_tokens=8, ignore_eos=True, seed=5, n=3)
        assert [o.token_ids for o in outs] == [[draw_key(5, i, k) % vocab for k in range(8)] for i in range(3)]
        assert [o.token_ids for o in gen(max_tokens=8, ignore_eos=True, seed=5, n=3)] == [o.token_ids for o in outs]
        # greedy: the same prompt gives the same output; n greedy sequences are equal
        greedy = gen(max_tokens=12, ignore_eos=True, temperature=0.0, n=2)
        assert greedy[0].token_ids == greedy[1].token_ids == gen(max_tokens=12, ignore_eos=True,
                                                                temperature=0.0)[0].token_ids
        # a seed whose draw at output position 5 is an EOS: it stops there, unless ignore_eos
        seed = next(s for s in range(1_000_000) if draw_key(s, 0, 5) % vocab in eos
                    and all(draw_key(s, 0, k) % vocab not in eos for k in range(5)))
        (stopped,) = gen(max_tokens=20, seed=seed)
        assert len(stopped.token_ids) == 6 and stopped.token_ids[-1] in eos and stopped.finish_reason == "stop"
        (ignored,) = gen(max_tokens=20, seed=seed, ignore_eos=True)
        assert len(ignored.token_ids) == 20 and ignored.token_ids[:6] == stopped.token_ids
        # before min_tokens the EOS is drawn again; the rest of the stream is the seed's
        (late,) = gen(max_tokens=20, seed=seed, min_tokens=8, ignore_eos=False)
        assert late.token_ids[:5] == stopped.token_ids[:5] and late.token_ids[5] not in eos
        assert late.token_ids[6:8] == [draw_key(seed, 0, k) % vocab for k in (6, 7)]
        # a stop token id ends the sequence with that id as its stop_reason
        third = draw_key(9, 0, 2) % vocab
        (cut,) = gen(max_tokens=20, seed=9, ignore_eos=True, stop_token_ids=[third])
        assert cut.token_ids[-1] == third and len(cut.token_ids) <= 3 and cut.stop_reason == third
        # logprobs and structured outputs go through the real sampler
        (lp,) = gen(max_tokens=4, seed=2, ignore_eos=True, logprobs=2)
        assert lp.token_ids == [draw_key(2, 0, k) % vocab for k in range(4)] and len(lp.logprobs) == 4
        assert [e.token_id for e in lp.logprobs] == lp.token_ids and all(len(e.top) == 2 for e in lp.logprobs)
        choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
        texts = {gen(max_tokens=20, seed=s, structured_outputs=choice)[0].text for s in range(6)}
        assert texts <= {"alpha", "beta", "gamma"}
        schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                             "additionalProperties": False})
        for seed in range(3):
            (js,) = gen(max_tokens=60, seed=seed, structured_outputs=StructuredOutputsParams(json=schema))
            assert js.finish_reason == "stop" and isinstance(json.loads(js.text)["n"], int), js.text
    finally:
        llm.shutdown()


def test_kv_events_of_a_simulated_engine_replay_to_its_pool(tiny_args):
    """Zero drift: the global scheduler's own view, fed every batch, equals the pool after traffic
    that fills the pool, evicts cached prefixes, preempts and aborts."""
    # 1 MiB: 64 blocks, which about 30 running requests outgrow
    engine = LLMEngine(dataclasses.replace(tiny_args, kv_cache_bytes=1 << 20, max_model_len=512))
    sched = GlobalScheduler()
    engine.enable_kv_events("w0")

    removed = []

    def drain():
        batch = engine.drain_kv_events()
        removed.append(batch.num_removed)
        sched.apply_batch(batch, time.monotonic())

    prefixes = [list(range(1000 - 64 * (t + 1), 1000 - 64 * t)) for t in range(6)]  # 6 tenants, 4 blocks each
    try:
        for i in range(60):
            prompt = prefixes[i % 6] + [5 + i, 6 + i, 7 + i]
            params = SamplingParams(max_tokens=40 + i % 5 * 20, ignore_eos=True, seed=i, n=2 if i % 7 == 0 else 1)
            engine.add_request(f"r{i}", prompt, params)
            if i % 6 == 5:  # six at a time
                for _ in range(12):
                    engine.step()
                    drain()
            if i % 9 == 4:
                engine.abort_request(f"r{i}")
                drain()
        while engine.has_unfinished():
            engine.step()
            drain()
        assert engine.scheduler.num_preemptions > 0  # the pool was full: sequences were preempted
        view = sched.workers["w0"]
        pool = engine.pool
        assert sched.keys_of("w0") == set(routing_keys(pack_hashes(pool.cached))) != set()
        assert sched.in_use_of("w0") == set() and all(b.ref_cnt == 0 for b in pool.cached.values())
        assert (view.num_free_blocks, view.num_total_blocks) == (pool.num_free, pool.num_blocks) == (64, 64)
        assert sched.counters.gaps == 0 and sum(removed) > 0  # cached prefixes were evicted too
    finally:
        engine.shutdown()


def test_idle_simulated_engines_cost_almost_no_cpu(tiny_args):
    engines = [AsyncLLMEngine(tiny_args) for _ in range(16)]
    try:
        async def one_request(engine):
            async for _ in engine.generate("warm", list(range(10, 40)), SamplingParams(max_tokens=4)):
                pass

        async def warm():
            await asyncio.gather(*(one_request(e) for e in engines))

        asyncio.run(warm())
        assert all(e.pinned_threads == {} for e in engines)  # no OpenMP team, no thread pinned to a core
        time.sleep(0.2)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(2.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        for engine in engines:
            engine.shutdown()
    # 16 idle engine threads (and this whole process) over 2 s: well under a tenth of a CPU-second
    assert wall >= 2.0 and cpu < 0.1, cpu


def test_bad_simulate_options_are_refused():
    with pytest.raises(ValueError, match="simulate must be one of"):
        EngineArgs(simulate="tpu-v9")
    with pytest.raises(ValueError, match="simulate_efficiency"):
        EngineArgs(simulate="h100", simulate_efficiency=0.0)
    with pytest.raises(ValueError, match="simulate_efficiency"):
        EngineArgs(simulate="h100", simulate_efficiency=1.5)
