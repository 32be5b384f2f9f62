"""Session-wide test setup: torch threads, GPU skipping, demo checkpoints.

Kept free of Ray: tests that need a cluster bring their own fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

# Must be set before torch loads libgomp, which reads it once. On a busy machine
# with few cores libgomp's default spin-waiting makes every small matmul on the
# main thread slow: spinning threads hold the cores the others wait for.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    # CI has 2 cores; more torch threads than that only adds contention.
    torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: `tiny_checkpoint(arch="llama", **kw) -> Path` of a demo checkpoint.

    Keyword arguments are those of `write_demo_checkpoint` (size defaults to
    "tiny"). Each distinct argument set is written once per session; callers
    must treat the directory as read-only."""
    from pagefleet.cluster.demo.model import write_demo_checkpoint

    root = tmp_path_factory.mktemp("demo_checkpoints")
    written: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in written:
            name = "-".join([arch] + [f"{k}={v}" for k, v in key[1]])
            written[key] = write_demo_checkpoint(root / name, arch=arch, **kwargs)
        return written[key]

    return make


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_checkpoint) -> Path:
    """Directory of the tiny Llama checkpoint, for tests that only need its tokenizer."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def _spans():
    """Tracing on in this process, into memory, for the rest of the session (OpenTelemetry takes
    one tracer provider per process)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagefleet.worker import tracing

    exporter = InMemorySpanExporter()
    tracing.init_tracing("memory", "pagefleet-test", exporter=exporter)
    return exporter


@pytest.fixture
def recorded(_spans):
    """The spans finished during the test (``get_finished_spans()``)."""
    _spans.clear()
    yield _spans
    _spans.clear()
