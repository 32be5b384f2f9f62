"""TP=2 through the Ray-actor executor on CPU (gloo) against TP=1, and failure handling.

Criterion (DESIGN.md): greedy ids equal, or at the first divergence each side's token is
in the other's top-5. Which cases need the second half is noted at CASES.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.model_executor.model_runner import StepInput
from pagefleet.worker.parallel.tp_executor import STEP_TIMEOUT_ENV, TPExecutor, TPWorkerError

from hf_reference import assert_greedy_close

MAX_NEW = 16
KV_BYTES = 16 << 20
PROMPTS = ["Hello, world! How are you today?", "The quick brown fox",
           "Once upon a time, there was a small model that served many requests. " * 3, "0 1 2 3"]

# Observed on CPU (torch 2.13): every case gives identical greedy ids at TP=2 and TP=1; the
# top-5 half of the criterion is there for near-ties that a different fp32 summation order
# (two half-sums meeting in the all-reduce) may flip on other machines.
CASES = {
    "llama_4kv_split": dict(arch="llama", num_key_value_heads=4),
    "llama_1kv_replicated": dict(arch="llama", num_key_value_heads=1),
    "qwen2_qkv_bias": dict(arch="qwen2"),
    "llama_odd_vocab": dict(arch="llama", vocab_size=999),
    "qwen3_qk_norm": dict(arch="qwen3"),
    # Each expert's intermediate dimension split over the ranks, the router replicated.
    "mixtral_experts_split": dict(arch="mixtral"),
    "qwen3_moe_with_a_dense_layer": dict(arch="qwen3_moe"),
    # Windows shorter than the long prompt: every layer sliding (its blocks freed as it goes), and
    # a full layer then a sliding one.
    "mistral_sliding_window": dict(arch="mistral", sliding_window=16),
    "qwen2_full_and_sliding_layers": dict(arch="qwen2", sliding_window=12, max_window_layers=1),
    # Sinks split with their heads, the experts' biases with their intermediate slices, a sliding
    # layer then a full one.
    "gpt_oss_sinks_and_windows": dict(arch="gpt_oss", sliding_window=12),
}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session, unless another fixture already started one."""
    import ray

    started = not ray.is_initialized()
    if started:
        # Logical CPUs: the 2-core CI box must still fit every rank's bundle.
        ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    yield
    if started:
        ray.shutdown()


def _generate(llm: LLM, prompts=PROMPTS, max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _ids_and_top5(out) -> tuple[list[int], list[set[int]]]:
    return out.token_ids, [{t for t, _ in lp.top} for lp in out.logprobs]


def _assert_close(tp2_outs, tp1_outs, what: str) -> None:
    for i, (a, b) in enumerate(zip(tp2_outs, tp1_outs, strict=True)):
        assert_greedy_close(*_ids_and_top5(a), *_ids_and_top5(b), f"{what}, prompt {i}")


def _tp1(path, **kw):
    llm = LLM(model=str(path), kv_cache_bytes=KV_BYTES, **kw)
    try:
        return _generate(llm), llm.engine.executor.runner.weight_bytes()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def baselines(tiny_checkpoint):
    """TP=1 outputs and weight bytes per case, computed once."""
    cache = {}

    def get(case: str):
        if case not in cache:
            cache[case] = _tp1(tiny_checkpoint(**CASES[case]))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_matches_tp1(ray_session, tiny_checkpoint, baselines, case):
    path = tiny_checkpoint(**CASES[case])
    want, tp1_bytes = baselines(case)
    llm = LLM(model=str(path), kv_cache_bytes=KV_BYTES, tensor_parallel_size=2)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, TPExecutor)
        assert executor.rendezvous_host == "127.0.0.1"  # one node: the group listens on loopback only
        cfg = llm.engine.model_config
        # Each rank's KV cache holds its share of the KV heads, or one replica when too few.
        assert executor.runner.num_kv_heads == max(1, cfg.num_kv_heads // 2)
        # Sharded weights: each rank holds half, plus the replicated norms (and, for an odd
        # vocabulary, one zero padding row of embedding and of LM head on the last rank).
        replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
        if cfg.qk_norm:
            replicated += 2 * cfg.num_layers * cfg.head_dim * 4
        replicated += len(cfg.moe_layers) * cfg.num_experts * cfg.hidden_size * 4  # the routers
        if cfg.attention_sinks:  # gpt-oss: the router and down-projection biases, o_proj's bias
            replicated += cfg.num_layers * (cfg.num_experts + cfg.num_experts * cfg.hidden_size + cfg.hidden_size) * 4
        if cfg.num_kv_heads < 2:  # the one KV head's k and v rows are on both ranks
            replicated += 2 * cfg.num_layers * cfg.head_dim * cfg.hidden_size * 4
        padding = 2 * (-cfg.vocab_size % 2) * cfg.hidden_size * 4
        assert [r.weight_bytes for r in executor.load_reports] == [(tp1_bytes + replicated + padding) // 2] * 2
        _assert_close(_generate(llm), want, case)
    finally:
        llm.engine.shutdown()


def test_tp2_with_forced_chunking_and_preemption(ray_session, tiny_checkpoint, baselines):
    path = tiny_checkpoint(**CASES["llama_4kv_split"])
    want, _ = baselines("llama_4kv_split")
    # 10 blocks of 16 tokens on each rank cannot hold all four sequences at once.
    per_block = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads per rank, head_dim 32, fp32
    llm = LLM(model=str(path), kv_cache_bytes=10 * per_block, tensor_parallel_size=2,
              max_num_batched_tokens=24, enable_prefix_caching=False, max_model_len=160)
    try:
        _assert_close(_generate(llm), want, "chunked + preempted")
        assert llm.engine.stats().num_preemptions > 0
        # A rank whose forward raises is reported with its own error (here every rank
        # fails the same way: a sampled row past the step's tokens).
        bad = StepInput(input_ids=[1, 2], positions=[0, 1], slot_mapping=[0, 1], block_tables=[[0]],
                        query_start_loc=[0, 2], seq_lens=[2], logits_indices=[5])
        with pytest.raises(TPWorkerError, match="rank 1 raised IndexError"):
            llm.engine.executor.execute(bad)
    finally:
        llm.engine.shutdown()


def _interrupt_rank1_after(llm: LLM, steps: int, sig: int, at: dict) -> threading.Thread:
    pid = llm.engine.executor.actor_pids[0]

    def run():
        while llm.engine.num_steps < steps:
            time.sleep(0.005)
        at["t"] = time.monotonic()
        os.kill(pid, sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_killed_rank_raises_clearly_and_a_new_engine_works(ray_session, tiny_checkpoint, baselines):
    path = tiny_checkpoint(**CASES["llama_4kv_split"])
    want, _ = baselines("llama_4kv_split")
    llm = LLM(model=str(path), kv_cache_bytes=KV_BYTES, tensor_parallel_size=2)
    at: dict = {}
    _interrupt_rank1_after(llm, 3, signal.SIGKILL, at)
    with pytest.raises(TPWorkerError, match=r"rank 1 \(pid \d+\) died"):
        _generate(llm, max_new=1000)
    # The bound: a dead rank is an error within 10 s (the socket closes, so it is
    # normally well under a second), never a hang.
    assert time.monotonic() - at["t"] < 10
    assert llm.engine.stats().num_running == 0  # generate aborted its requests
    with pytest.raises(TPWorkerError, match="rank 1"):
        llm.engine.executor.execute(None)  # torn down: every later call fails the same way
    llm.engine.shutdown()

    fresh = LLM(model=str(path), kv_cache_bytes=KV_BYTES, tensor_parallel_size=2)
    try:
        _assert_close(_generate(fresh), want, "engine rebuilt after a dead rank")
        # An actor that dies while the engine is idle shows up in the health check.
        os.kill(fresh.engine.executor.actor_pids[0], signal.SIGKILL)
        with pytest.raises(TPWorkerError, match="rank 1"):
            for _ in range(200):
                fresh.engine.executor.check_health()
                time.sleep(0.05)
    finally:
        fresh.engine.shutdown()


def test_hung_rank_raises_after_the_step_timeout(ray_session, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "2")
    llm = LLM(model=str(tiny_checkpoint(**CASES["llama_4kv_split"])), kv_cache_bytes=KV_BYTES,
              tensor_parallel_size=2)
    pid = llm.engine.executor.actor_pids[0]
    try:
        _interrupt_rank1_after(llm, 3, signal.SIGSTOP, {})
        with pytest.raises(TPWorkerError, match="a rank is hung .*step timeout 2 s"):
            _generate(llm, max_new=1000)
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.engine.shutdown()


def _replica_like_class():
    """Stands in for a Serve worker replica: an actor in bundle 0 of its own placement group.
    Defined in a function so Ray ships it by value (workers cannot import test modules)."""

    class ReplicaLike:
        def __init__(self, path: str, kv_bytes: int, prompts: list[str], max_new: int) -> None:
            from pagefleet.worker import LLM

            self.llm = LLM(model=path, kv_cache_bytes=kv_bytes, tensor_parallel_size=2)
            self.prompts, self.max_new = prompts, max_new

        def run(self) -> tuple[list[list[int]], str, bool]:
            from pagefleet.worker import SamplingParams

            placement = self.llm.engine.executor.placement
            params = SamplingParams(temperature=0.0, max_tokens=self.max_new, ignore_eos=True)
            outs = self.llm.generate(self.prompts, params)
            self.llm.engine.shutdown()
            return [o.outputs[0].token_ids for o in outs], placement.group.id.hex(), placement.owned

    return ReplicaLike


def test_engine_inside_a_placement_group_uses_its_bundles(ray_session, tiny_checkpoint, baselines):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    want, _ = baselines("llama_4kv_split")
    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    try:
        replica = ray.remote(_replica_like_class()).options(
            num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(str(tiny_checkpoint(**CASES["llama_4kv_split"])), KV_BYTES, PROMPTS, MAX_NEW)
        ids, group_id, owned = ray.get(replica.run.remote(), timeout=120)
        # Rank 1 went into the replica's own group (bundle 1), not a group of its own.
        assert (group_id, owned) == (group.id.hex(), False)
        assert ids == [o.token_ids for o in want]
        ray.kill(replica)
    finally:
        remove_placement_group(group)
