"""The CPU linear layers: oneDNN-packed weights, and the one-row path chosen by measurement at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.worker import cpu_linear
from pagefleet.worker.cpu_linear import PackedWeight, linear, pack_linear_weights, pack_weight

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch build has no oneDNN linear")


class _Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
        self.packed_weight: PackedWeight | None = None


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_every_path_computes_the_product(one_row, rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(rows, 64)
    packed = pack_weight(weight)
    packed.one_row = one_row
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_one_row_takes_the_packed_copy_only_when_it_was_measured_faster(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    weight = torch.randn(16, 32)
    packed = pack_weight(weight)
    with torch.inference_mode():
        linear(torch.randn(1, 32), weight, None, packed)
        linear(torch.randn(5, 32), weight, None, packed)
        packed.one_row = True
        linear(torch.randn(1, 32), weight, None, packed)
    assert calls == [5, 1]


def test_the_decision_is_measured_over_the_sample_and_given_to_every_module(monkeypatch):
    torch.manual_seed(0)
    model = nn.ModuleList([_Linear(64, 32), _Linear(128, 32), _Linear(64, 128)])
    model.append(nn.Linear(4, 4))  # no packed_weight slot: left alone
    # A sample budget of one weight's bytes takes exactly the first module.
    monkeypatch.setattr(cpu_linear, "ONE_ROW_SAMPLE_BYTES", 64 * 32 * 4)
    count, timing = pack_linear_weights(model)
    assert count == 3
    assert timing.sample_bytes == 64 * 32 * 4
    assert timing.plain_ms > 0 and timing.packed_ms > 0
    assert [m.packed_weight.one_row for m in model[:3]] == [timing.packed_ms < timing.plain_ms] * 3

    # Without a budget every weight is in the sample.
    monkeypatch.setattr(cpu_linear, "ONE_ROW_SAMPLE_BYTES", 1 << 40)
    _, timing = pack_linear_weights(model)
    assert timing.sample_bytes == (64 * 32 + 128 * 32 + 64 * 128) * 4


def test_a_model_without_packable_weights_reports_none():
    model = nn.ModuleList([_Linear(8, 8).to(torch.float64)])
    assert pack_linear_weights(model) == (0, None)
    assert model[0].packed_weight is None
