import pytest
from fastapi.testclient import TestClient

from serving_fakes import MAX_MODEL_LEN, MODEL, FakeWorkerClient, make_tokenizer
from pagefleet.router.openai_app import build_openai_app
from pagefleet.router.preprocess import ModelInfo
from pagefleet.router.service import OpenAIService
from pagefleet.worker.request_check import RequestLimits


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


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, started by the first test that needs it.

    Logical CPUs exceed the real cores on purpose: replicas reserve Ray CPUs, not cores.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    if started and ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()
