import pytest
from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.preprocess import ModelInfo
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.request_check import RequestLimits

from serving_fakes import MAX_MODEL_LEN, MODEL, FakeWorkerClient, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def fake(tokenizer):
    return FakeWorkerClient(tokenizer, vocab_size=len(tokenizer))


@pytest.fixture
def info(tokenizer):
    return ModelInfo(served_model_name=MODEL,
                     limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=MAX_MODEL_LEN, max_num_seqs=8))


@pytest.fixture
def service(tokenizer, info, fake):
    return OpenAIService(tokenizer=tokenizer, info=info, client=fake)


@pytest.fixture
def client(service):
    with TestClient(build_openai_app(service)) as c:
        yield c


def free_port() -> int:
    """A port for the tests' servers: outside the range Ray's processes get theirs from, and never
    one handed out before in this run (``free_ports`` remembers them)."""
    from pagefleet.cluster.serve_env import free_ports

    return free_ports(1)[0]


# Tests on the session's Ray cluster that failed, and its temp dir when they did: the dir is then
# kept, and the end of the run shows what Serve's controller and the replicas warned about.
_CLUSTER_FAILURES: list[str] = []
_KEPT_RAY_DIR: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "ray_cluster" in getattr(item, "fixturenames", ()):
        _CLUSTER_FAILURES.append(item.nodeid)


@pytest.fixture(scope="session")
def ray_temp_dir():
    """This session's own Ray temp dir (short: Ray's unix socket paths must fit 107 bytes), so its
    Prometheus service-discovery file is not another Ray's on the same machine. Removed at the
    end, unless a test on the cluster failed: its logs are the evidence."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="/tmp/pf-ray-")
    yield path
    if _CLUSTER_FAILURES:
        _KEPT_RAY_DIR.append(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    if not _KEPT_RAY_DIR:
        return
    from cluster_helpers import serve_log_warnings

    tr = terminalreporter
    tr.section("Ray logs of the failed cluster tests")
    tr.write_line(f"kept at {_KEPT_RAY_DIR[0]} (failed: {', '.join(_CLUSTER_FAILURES)})")
    for line in serve_log_warnings(_KEPT_RAY_DIR[0]):
        tr.write_line(line)


@pytest.fixture(scope="session")
def ray_cluster(ray_temp_dir):
    """One local Ray cluster for the whole session, started by the first test that needs it.

    Logical CPUs exceed the real cores on purpose: replicas reserve Ray CPUs, not cores.
    The dashboard process is on because it writes Prometheus' service-discovery file; metrics
    are reported every second (Ray's default is 10 s) so metric tests wait less.
    """
    import ray

    from pagefleet.cluster.serve_env import WORKER_PRIORITY_ENV, fast_path_env, raylet_env

    started = not ray.is_initialized()
    if started:
        # the HTTP path `pagefleet serve` runs (HAProxy in front), its processes at its priorities
        with raylet_env({**fast_path_env(), **WORKER_PRIORITY_ENV}):
            ray.init(num_cpus=8, include_dashboard=True, dashboard_port=free_port(), log_to_driver=False,
                     _temp_dir=ray_temp_dir, _metrics_export_port=free_port(),
                     _system_config={"metrics_report_interval_ms": 1000})
    yield ray.get_runtime_context().gcs_address
    if started and ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_http_port(ray_cluster) -> int:
    """Serve's HTTP port for the session: Serve keeps the port it first started with, so every
    module that deploys an app on the session cluster uses this one."""
    return free_port()

