"""The Serve adapters without a cluster: worker replica class, deployment options, app builder, serve.yaml."""

import asyncio
from pathlib import Path

import pytest
import yaml

from pagefleet.cluster.app import build_app
from pagefleet.cluster.config import ServeOptions
from pagefleet.worker.core.block_hash import block_hashes, extra_keys_digest, pack_hashes
from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.metrics.stats import EngineStats, ReplicaStats
from pagefleet.worker.options import parse_bytes
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.replica.deployment import WorkerReplica, worker_deployment_options
from pagefleet.worker.replica.wire import FRAME_HEADER, WorkerRequest, decode_commands, encode_commands
from pagefleet.worker.sampling_params import SamplingParams

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


class _ModelConfig:
    served_model_name = "m"
    max_model_len = 128


class FakeEngine:
    def __init__(self, args):
        self.args = args
        self.model_config = _ModelConfig()
        self.dead = False
        self.closed = []
        self.received = []
        self.priorities = []

    async def generate(self, request_id, prompt_token_ids, params, extra_keys=(), block_hashes=None, span=None,
                       resume=None, forward=None, client="", priority=0, lora_name=None, lora_path=None):
        self.received.append((request_id, extra_keys, block_hashes, resume))
        self.priorities.append(priority)
        try:
            for step in range(params.max_tokens):
                last = step == params.max_tokens - 1
                yield RequestOutputDelta(request_id, [CompletionOutput(0, "x", [step], None, "length" if last else None)],
                                         len(prompt_token_ids), 0, last)
        finally:
            self.closed.append(request_id)

    def abort(self, request_id):
        return False

    def stats(self):
        return EngineStats(100, 90, 1, 2, 0, 0, 0, 5, 10, 20)

    def check_health(self):
        if self.dead:
            raise RuntimeError("the engine loop died")

    def shutdown(self):
        pass


def test_worker_replica_streams_and_publishes_its_load():
    replica = WorkerReplica(EngineArgs(), engine_factory=FakeEngine)

    hashes = block_hashes(list(range(40)), 16, extra_keys_digest(("salt",)))

    async def run():
        request = WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3), pack_hashes(hashes), ("salt",))
        return [d async for d in replica.generate(request)]

    deltas = asyncio.run(run())
    assert [d.sequences[0].token_ids for d in deltas] == [[0], [1], [2]]
    assert deltas[-1].finished
    # the ingress's hashes as they came: packed, for the engine to unpack once
    assert replica.engine.received == [("r1", ("salt",), pack_hashes(hashes), None)]
    published = asyncio.run(replica.record_routing_stats())
    assert ReplicaStats.from_routing_stats(published) == ReplicaStats(
        replica_id="local", healthy=True, num_requests_total=1, engine=EngineStats(100, 90, 1, 2, 0, 0, 0, 5, 10, 20))


def test_worker_replica_hands_a_resumed_request_to_the_engine_with_its_state():
    replica = WorkerReplica(EngineArgs(), engine_factory=FakeEngine)
    resume = ResumeState(output_token_ids=[5, 6, 7], emitted_text_chars=4, seq_index=1)

    async def run():
        request = WorkerRequest("r3", [1, 2], SamplingParams(max_tokens=2), resume=resume)
        return [d async for d in replica.generate(request)]

    assert len(asyncio.run(run())) == 2
    assert replica.engine.received == [("r3", (), b"", ResumeState([5, 6, 7], 4, 1))]


def test_a_requests_priority_crosses_the_wire_and_reaches_the_engine():
    replica = WorkerReplica(EngineArgs(), engine_factory=FakeEngine)
    sent = WorkerRequest("r4", [1, 2], SamplingParams(max_tokens=1), priority=-7)
    (request,) = decode_commands(encode_commands([sent])[FRAME_HEADER.size:])
    assert request.priority == -7

    async def run():
        return [d async for d in replica.generate(request)]

    assert len(asyncio.run(run())) == 1
    assert replica.engine.priorities == [-7]


def test_worker_replica_health_is_the_engines():
    replica = WorkerReplica(EngineArgs(), engine_factory=FakeEngine)
    asyncio.run(replica.check_health())
    replica.engine.dead = True
    with pytest.raises(RuntimeError, match="loop died"):
        asyncio.run(replica.check_health())
    assert replica.stats().healthy is False


def test_closing_the_worker_stream_closes_the_engine_stream():
    replica = WorkerReplica(EngineArgs(), engine_factory=FakeEngine)

    async def run():
        gen = replica.generate(WorkerRequest("r2", [1], SamplingParams(max_tokens=10)))
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(run())
    assert replica.engine.closed == ["r2"]


def test_deployment_options_single_rank_and_tensor_parallel():
    opts = worker_deployment_options(EngineArgs(max_num_seqs=8), num_replicas=2, num_cpus=0.5)
    assert opts["num_replicas"] == 2
    assert opts["max_ongoing_requests"] == 16 + 1  # 2 x max_num_seqs requests, one ingress's delta channel
    assert worker_deployment_options(EngineArgs(max_num_seqs=8), channels=3)["max_ongoing_requests"] == 16 + 3
    assert opts["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert "placement_group_bundles" not in opts
    tp = worker_deployment_options(EngineArgs(tensor_parallel_size=4), num_cpus=1, num_gpus_per_rank=1)
    assert tp["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}] * 4
    assert tp["placement_group_strategy"] == "STRICT_PACK"
    assert tp["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    with pytest.raises(ValueError, match="num_replicas"):
        worker_deployment_options(EngineArgs(), num_replicas=0)
    # a caller's actor options add to these; a runtime_env goes with them
    merged = worker_deployment_options(EngineArgs(), num_cpus=0.5, runtime_env={"env_vars": {"A": "1"}},
                                       ray_actor_options={"memory": 1 << 30})
    assert merged["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0, "memory": 1 << 30,
                                           "runtime_env": {"env_vars": {"A": "1"}}}


@pytest.mark.parametrize("text, expected", [
    (536870912, 536870912), ("536870912", 536870912), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30),
    ("2gib", 2 * 2**30), ("1.5GB", 1_500_000_000), ("64K", 64_000), ("1 MiB", 2**20),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-5MiB", 0, -1, True, "0GiB"])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_serve_options_check_everything_up_front():
    opts = ServeOptions.from_dict({"kv_cache_bytes": "64MiB", "workers": 2, "max_num_seqs": 4})
    args = opts.engine
    assert (args.kv_cache_bytes, args.max_num_seqs, args.model) == (64 * 2**20, 4, None)
    assert opts.serve.workers == 2
    assert opts.logical_cpus_needed() == 2.5
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['num_workers'\]"):
        ServeOptions.from_dict({"num_workers": 2})
    with pytest.raises(ValueError, match="not both"):
        ServeOptions.from_dict({"kv_cache_bytes": 2**20, "gpu_memory_utilization": 0.5})
    with pytest.raises(ValueError, match="workers must be an integer >= 1, got 0"):
        ServeOptions.from_dict({"workers": 0})
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32, 64, 128, got 5"):
        ServeOptions.from_dict({"block_size": 5})


def test_build_app_accepts_the_yaml_args_and_refuses_unknown_ones(tiny_checkpoint):
    config = yaml.safe_load(SERVE_YAML.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "pagefleet.cluster.app:build_app"
    assert app["args"]["routing"] == "kv"
    model = str(tiny_checkpoint("llama"))
    # round_robin: no global scheduler to start, so no cluster needed here
    built = build_app({**app["args"], "model": model, "workers": 2, "worker_num_cpus": 0.5, "api_key": "k",
                       "routing": "round_robin"})
    ingress = built._bound_deployment  # Serve has no public accessor for an Application's deployment
    worker_app, engine_args = ingress.init_args
    kwargs = ingress.init_kwargs
    worker = worker_app._bound_deployment
    assert (ingress.name, ingress.num_replicas, kwargs["api_key"], kwargs["kv_scheduler"]) == \
        ("OpenAIIngress", 1, "k", None)
    assert (worker.name, worker.num_replicas, worker.ray_actor_options["num_cpus"]) == ("PagefleetWorker", 2, 0.5)
    assert worker.init_args[0] == engine_args and worker.init_args[2] is None and engine_args.model == model
    router = worker._deployment_config.request_router_config  # no public accessor either
    assert router.request_router_class == "pagefleet.router.routing.request_router:RoundRobinRouter"
    kv_routing = kwargs["kv_routing"]
    assert (kv_routing.cost_weight, kv_routing.admission_queue_size, kv_routing.admission_max_wait_s) == (4.0, 64, 2.0)
    assert worker._deployment_config.max_queued_requests == 64  # Serve's queue: the same bound
    assert "runtime_env" not in worker.ray_actor_options  # two replicas share this machine's cores
    with pytest.raises(ValueError, match="unknown option"):
        build_app({"replicas": 3})
    with pytest.raises(ValueError, match="routing must be one of kv, least_loaded, pow2, round_robin, prefix, ray_prefix"):
        build_app({"routing": "random"})


def test_serve_yaml_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text()))
    assert [a.name for a in schema.applications] == ["pagefleet"]
    assert schema.http_options.port == 8000
    assert schema.http_options.host == "127.0.0.1"


def test_build_app_spins_the_team_of_a_lone_cpu_worker_in_its_process_environment(tiny_checkpoint, monkeypatch):
    import pagefleet.cluster.app as app_module

    monkeypatch.setattr(app_module, "available_cores", lambda: 4)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    built = build_app({"model": str(tiny_checkpoint("llama")), "routing": "round_robin"})
    worker_app, engine_args = built._bound_deployment.init_args
    assert engine_args.cpu_omp_threads == 4
    assert worker_app._bound_deployment.ray_actor_options["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": "300000"}}


def test_simulated_workers_reserve_no_gpu_spin_no_team_and_start_no_rank_actors(tiny_checkpoint, monkeypatch):
    import pagefleet.cluster.app as app_module

    monkeypatch.setattr(app_module, "available_cores", lambda: 4)
    monkeypatch.setattr(app_module, "_cluster_has_gpus", lambda: True)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    built = build_app({"model": str(tiny_checkpoint("llama")), "routing": "round_robin", "simulate": "h200",
                       "tensor_parallel_size": 2})
    worker_app, engine_args = built._bound_deployment.init_args
    deployment = worker_app._bound_deployment
    assert engine_args.simulate == "h200"
    assert deployment.ray_actor_options["num_gpus"] == 0.0 and "runtime_env" not in deployment.ray_actor_options
    assert deployment._replica_config.placement_group_bundles is None  # one process: no rank actors to place
    assert "placement_group_bundles" not in worker_deployment_options(EngineArgs(simulate="h200",
                                                                                 tensor_parallel_size=4))
