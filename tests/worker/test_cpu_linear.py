"""The CPU linear layers: oneDNN-packed weights, and the one-row path chosen by measurement at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels.cpu import fused_ops as cpu_fused_ops
from pagefleet.worker.cpu import linear as cpu_linear
from pagefleet.worker.cpu.linear import PackedWeight, linear, pack_linear_weights, pack_weight

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch build has no oneDNN linear")


class _Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
        self.packed_weight: PackedWeight | None = None


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path_factory.getbasetemp() / "pagefleet-cache"))


@pytest.mark.parametrize("one_row", cpu_linear.ONE_ROW_PATHS)
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("out_features", [48, 61])  # 61: no multiple of any vector width
def test_every_path_computes_the_product(one_row, rows, out_features):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(out_features, 64), torch.randn(out_features), torch.randn(rows, 64)
    packed = pack_weight(weight)
    packed.one_row = one_row
    with torch.inference_mode():
        for b in (bias, None):
            torch.testing.assert_close(linear(x, weight, b, packed), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_one_row_takes_the_path_that_was_measured_fastest(monkeypatch):
    calls = []
    onednn, gemv = torch.ops.mkldnn._linear_pointwise, cpu_fused_ops.gemv
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(("packed", a[0].shape[0])) or onednn(*a), raising=False)
    monkeypatch.setattr(cpu_fused_ops, "gemv", lambda *a: calls.append(("gemv", a[0].shape[0])) or gemv(*a))
    weight = torch.randn(16, 32)
    packed = pack_weight(weight)
    with torch.inference_mode():
        for path in cpu_linear.ONE_ROW_PATHS:
            packed.one_row = path
            linear(torch.randn(1, 32), weight, None, packed)
            linear(torch.randn(5, 32), weight, None, packed)  # several rows: always the packed copy
    assert calls == [("packed", 5), ("packed", 1), ("packed", 5), ("gemv", 1), ("packed", 5)]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_decision_is_measured_over_the_sample_and_given_to_every_module(monkeypatch, compiled):
    torch.manual_seed(0)
    model = nn.ModuleList([_Linear(64, 32), _Linear(128, 32), _Linear(64, 128)])
    model.append(nn.Linear(4, 4))  # no packed_weight slot: left alone
    # A sample budget of one weight's bytes takes exactly the first module.
    monkeypatch.setattr(cpu_linear, "ONE_ROW_SAMPLE_BYTES", 64 * 32 * 4)
    count, timing = pack_linear_weights(model, compiled_kernels=compiled)
    assert count == 3
    assert timing.sample_bytes == 64 * 32 * 4
    # The C++ product is a candidate only where the engine compiles its kernels.
    assert tuple(timing.ms) == (cpu_linear.ONE_ROW_PATHS if compiled else ("plain", "packed"))
    assert all(ms > 0 for ms in timing.ms.values())
    fastest = min(timing.ms, key=timing.ms.get)
    assert [m.packed_weight.one_row for m in model[:3]] == [fastest] * 3

    # Without a budget every weight is in the sample.
    monkeypatch.setattr(cpu_linear, "ONE_ROW_SAMPLE_BYTES", 1 << 40)
    _, timing = pack_linear_weights(model, compiled_kernels=compiled)
    assert timing.sample_bytes == (64 * 32 + 128 * 32 + 64 * 128) * 4


def test_a_model_without_packable_weights_reports_none():
    model = nn.ModuleList([_Linear(8, 8).to(torch.float64)])
    assert pack_linear_weights(model) == (0, None)
    assert model[0].packed_weight is None


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_packed_experts_compute_the_mixture_the_plain_weights_do(tokens):
    from pagefleet.kernels.reference import fused_moe
    from pagefleet.worker.cpu.linear import pack_experts

    torch.manual_seed(0)
    experts, hidden, inter, top_k = 4, 64, 96, 2
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.1, torch.randn(experts, hidden, inter) * 0.1
    x = torch.randn(tokens, hidden)
    topk_weights, topk_ids = torch.rand(tokens, experts).softmax(-1).topk(top_k, dim=-1)
    packed = pack_experts(w13, w2)
    assert len(packed.w13) == len(packed.w2) == experts
    with torch.inference_mode():
        torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids, packed=packed),
                                   fused_moe(x, w13, w2, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)


def test_a_cpu_engine_packs_every_mixture_of_experts(tiny_checkpoint):
    from pagefleet.worker import LLM
    from pagefleet.worker.model_executor.moe import FusedExperts

    llm = LLM(model=str(tiny_checkpoint("mixtral")), device="cpu", kv_cache_bytes=8 << 20)
    experts = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.packed_experts is not None for m in experts)
    assert [len(m.packed_experts.w13) for m in experts] == [m.w13.shape[0] for m in experts]
