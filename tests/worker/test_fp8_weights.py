"""FP8 weights (``quantization="fp8"``, worker/model_executor/fp8.py) on CPU, where the PyTorch
twin of the scaled FP8 product runs.

Tolerances come from e4m3's format: 3 mantissa bits, so rounding a normal value moves it by at
most half a unit in the last place, 2^-4 of its magnitude; below the smallest normal (2^-6 of
the row's scale) the step is fixed, 2^-9 of the scale, so the error is at most 2^-10 of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagefleet.kernels import reference
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.cpu.linear import onednn_available
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.compressed_tensors import checkpoint_quantization
from pagefleet.worker.model_executor.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    WEIGHT_ONLY_MAX_TOKENS,
    check_fp8_device,
    dequantize_weight,
    fp8_linear,
    quantize_per_token,
    quantize_weight,
)
from pagefleet.worker.model_executor.layers import QKVParallelLinear
from pagefleet.worker.model_executor.model_config import load_model_config
from pagefleet.worker.model_executor.model_runner import ModelRunner, StepInput
from pagefleet.worker.model_executor.quantization import fp8_linears, resolve_quantization
from pagefleet.worker.parallel.tp_group import SINGLE, TPGroup

CPU = torch.device("cpu")
HALF_ULP = 2.0**-4      # e4m3 rounding, relative, normal values
SUBNORMAL_STEP = 2.0**-10  # e4m3 rounding below the smallest normal, relative to the scale
FP32_EPS = 2.0**-23
_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A fixed prompt: 20 tokens spread over the tiny vocabulary, two KV blocks of 16.
PROMPT = list(range(3, 3 + 7 * 20, 7))


def _rounding_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # v: [R, C] full precision; scale: [R, 1] -> [R, C] the most e4m3 rounding can move each value
    return torch.maximum(HALF_ULP * v.abs(), SUBNORMAL_STEP * scale)


# ---- the math -------------------------------------------------------------------------------

def test_quantize_weight_maps_each_rows_absmax_to_448_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g).to(torch.bfloat16)
    w[5] = 0                 # an all-zero output channel
    w[7] *= 1000             # channels of very different magnitude keep their own scales
    w[9] = 0
    w[9, 3] = 1e-30          # a row whose absmax is tiny
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == (48, 80)
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    assert scale[5].item() == 1.0 and torch.equal(q[5].float(), torch.zeros(80))
    nonzero = [r for r in range(48) if r != 5]
    assert torch.equal(q[nonzero].float().abs().amax(dim=1), torch.full((47,), FP8_MAX))
    wf = w.float()
    assert torch.allclose(scale[nonzero], wf[nonzero].abs().amax(dim=1) / FP8_MAX, rtol=0, atol=0)
    err = (dequantize_weight(q, scale) - wf).abs()
    assert (err <= _rounding_bound(wf, scale[:, None]) * (1 + 2 * FP32_EPS)).all()
    assert err.max() > 0  # something was rounded: the weights really are 8-bit


def test_quantize_weight_refuses_what_is_not_a_float_matrix():
    with pytest.raises(ValueError, match=r"\[out, in\] matrix, got shape \(2, 3, 4\)"):
        quantize_weight(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="float32/bfloat16/float16 weight, got torch.float8_e4m3fn"):
        quantize_weight(torch.zeros(2, 3).to(FP8_DTYPE))


def test_per_token_scales_map_each_rows_absmax_to_448_and_a_zero_row_to_zeros():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    x[2] = 0
    q, scale = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(q[2].float(), torch.zeros(40))
    assert torch.equal(q[[0, 1, 3, 4, 5]].float().abs().amax(dim=1), torch.full((5,), FP8_MAX))


def test_few_tokens_multiply_fp8_weights_with_the_activations_as_they_are():
    g = torch.Generator().manual_seed(5)
    w, sw = quantize_weight(torch.randn(48, 80, generator=g))
    bias = torch.randn(48, generator=g)
    for tokens in (1, 17, WEIGHT_ONLY_MAX_TOKENS):
        x = torch.randn(tokens, 80, generator=g).to(torch.bfloat16)
        got = fp8_linear(x, w, sw, bias, torch.float32)
        assert torch.equal(got, reference.fp8_weight_matmul(x, w, sw, bias, torch.float32))
        ref = x.double() @ (w.double() * sw.double()[:, None]).t() + bias.double()
        bound = (80 + 2) * FP32_EPS * (x.double().abs() @ (w.double().abs() * sw.double()[:, None]).t()
                                       + bias.double().abs())
        assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("tokens", [WEIGHT_ONLY_MAX_TOKENS + 1, 80])
def test_fp8_linear_equals_the_dequantized_product_up_to_fp32_summation(tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 80, generator=g).to(torch.bfloat16)
    w, sw = quantize_weight(torch.randn(48, 80, generator=g))
    bias = torch.randn(48, generator=g)
    got = fp8_linear(x, w, sw, bias, torch.float32)
    xq, sx = quantize_per_token(x)
    x_deq, w_deq = xq.double() * sx.double(), w.double() * sw.double()[:, None]
    ref = x_deq @ w_deq.t() + bias.double()
    # fp32 products and sums in some order: each of the 80 partial sums rounds once.
    bound = (80 + 2) * FP32_EPS * (x_deq.abs() @ w_deq.abs().t() + bias.double().abs())
    assert ((got.double() - ref).abs() <= bound).all()
    # Cast once at the end: a bf16 result is the fp32 one rounded, nothing else.
    assert torch.equal(fp8_linear(x, w, sw, bias, torch.bfloat16), got.to(torch.bfloat16))


def test_fp8_linear_is_within_e4m3_rounding_of_the_full_precision_product():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(WEIGHT_ONLY_MAX_TOKENS + 9, 80, generator=g).to(torch.bfloat16)
    w_full = (torch.randn(48, 80, generator=g) * 0.02).to(torch.bfloat16)
    w, sw = quantize_weight(w_full)
    got = fp8_linear(x, w, sw, None, torch.float32).double()
    xf, wf = x.double(), w_full.double()
    ref = xf @ wf.t()
    # |x^ w^ - x w| <= |x| e_w + e_x |w| + e_x e_w, term by term, e the rounding bound of each side.
    _, sx = quantize_per_token(x)
    e_x, e_w = _rounding_bound(xf, sx.double()), _rounding_bound(wf, sw.double()[:, None])
    bound = xf.abs() @ e_w.t() + e_x @ wf.abs().t() + e_x @ e_w.t()
    err = (got - ref).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-9).all()
    assert err.max() > 0
    # Rounding errors of random sign mostly cancel: the whole product is off by a few percent.
    assert (got - ref).norm() / ref.norm() < 0.05


def test_a_gpu_below_compute_capability_8_9_is_refused_by_name():
    message = (r"FP8 weights need compute capability 8\.9\+ \(Ada/Hopper\); this GPU is NVIDIA A100-SXM4-80GB "
               r"\(compute capability 8\.0\)")
    with pytest.raises(ValueError, match=message):
        check_fp8_device("cuda", capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    check_fp8_device("cuda", capability=(8, 9), name="NVIDIA L40S")
    check_fp8_device("cuda", capability=(9, 0), name="NVIDIA H200")
    check_fp8_device("cpu")  # the twin runs anywhere


# ---- checkpoints ----------------------------------------------------------------------------

def _ct_config(strategy: str = "channel", **group_changes) -> dict:
    """A compressed-tensors quantization_config as llm-compressor's FP8_DYNAMIC scheme writes it."""
    group = {
        "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True},
        "output_activations": None,
        "targets": ["Linear"],
    }
    group.update(group_changes)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": group}, "kv_cache_scheme": None}


def write_fp8_checkpoint(src: Path, dst: Path, strategy: str) -> Path:
    """``src``'s checkpoint with every decoder linear weight stored in FP8 as compressed-tensors
    stores it: per channel through ``quantize_weight`` (scale [out, 1]) or per tensor (scale [1])."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = {}
        for name, t in load_file(file).items():
            if name.endswith(".weight") and name.split(".")[-2] in _LINEAR_NAMES:
                if strategy == "channel":
                    q, scale = quantize_weight(t)
                    scale = scale[:, None]
                else:
                    scale = (t.float().abs().amax() / FP8_MAX).reshape(1)
                    q = (t.float() / scale).to(FP8_DTYPE)
                tensors[name], tensors[name + "_scale"] = q, scale
            else:
                tensors[name] = t
        save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _ct_config(strategy)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", dtype="bfloat16")


@pytest.fixture(scope="module")
def fp8_checkpoints(bf16_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_checkpoints")
    return {s: write_fp8_checkpoint(bf16_checkpoint, root / s, s) for s in ("channel", "tensor")}


def _runner(checkpoint: Path, quantization: str | None = None) -> ModelRunner:
    runner = ModelRunner(load_model_config(str(checkpoint)), SINGLE, CPU, enforce_eager=True,
                         quantization=quantization)
    runner.allocate_kv_cache(8, 16)
    return runner


def _prompt_logits(runner: ModelRunner) -> torch.Tensor:
    # -> [20, vocab]: the next-token logits after every prefix of PROMPT
    n = len(PROMPT)
    step = StepInput(PROMPT, list(range(n)), list(range(n)), [[0, 1]], [0, n], [n], list(range(n)))
    return runner.execute(step)


def _linear_weight_bytes(runner: ModelRunner) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in fp8_linears(runner.model))


def test_fp8_halves_the_linear_weights_and_keeps_the_logits_close(bf16_checkpoint):
    bf16, fp8 = _runner(bf16_checkpoint), _runner(bf16_checkpoint, "fp8")
    linears = fp8_linears(fp8.model)
    assert len(linears) == 2 * 4  # q|k|v, o, gate|up, down in each of the 2 layers
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale.shape == (m.weight.shape[0],) for m in linears)
    assert _linear_weight_bytes(fp8) * 2 == _linear_weight_bytes(bf16)
    # As vLLM: the embeddings and lm_head stay in the model's dtype.
    assert fp8.model.embed_tokens.weight.dtype == fp8.model.lm_head.weight.dtype == torch.bfloat16
    a, b = _prompt_logits(bf16), _prompt_logits(fp8)
    cosine = F.cosine_similarity(a, b, dim=-1)
    # Measured on this checkpoint: 0.9993 at the worst prefix, 0.9997 on average.
    assert cosine.min() >= 0.995
    assert not torch.equal(a, b)


def test_the_cpu_platform_packs_the_full_precision_linears_only(tiny_checkpoint):
    runner = _runner(tiny_checkpoint("llama"), "fp8")  # fp32: the weights oneDNN packs
    assert all(m.packed_weight is None for m in fp8_linears(runner.model))
    if onednn_available():
        assert runner.model.lm_head.packed_weight is not None


def test_an_engine_with_quantization_fp8_generates_what_the_prequantized_checkpoint_does(bf16_checkpoint,
                                                                                         fp8_checkpoints):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for model, quantization in ((bf16_checkpoint, "fp8"), (fp8_checkpoints["channel"], None)):
        llm = LLM(model=str(model), quantization=quantization, device="cpu", enforce_eager=True,
                  kv_cache_bytes=16 << 20)
        (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params)
        llm.shutdown()
        assert out.outputs[0].finish_reason == "length"
        tokens.append(out.outputs[0].token_ids)
    assert len(tokens[0]) == 12
    assert tokens[0] == tokens[1]


def test_a_channel_scaled_checkpoint_loads_as_stored_and_equals_quantizing_at_load(bf16_checkpoint,
                                                                                   fp8_checkpoints):
    path = fp8_checkpoints["channel"]
    assert load_model_config(str(path)).quantization == "fp8"
    stored = load_file(next(path.glob("*.safetensors")))
    loaded = _runner(path)  # no --quantization: the checkpoint says FP8
    qkv = loaded.model.layers[1].self_attn.qkv_proj
    names = [f"model.layers.1.self_attn.{n}_proj.weight" for n in "qkv"]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([stored[n] for n in names]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([stored[n + "_scale"][:, 0] for n in names]))
    # The same math as quantizing the bf16 checkpoint at load: the same bits, the same logits.
    at_load = _runner(bf16_checkpoint, "fp8")
    for a, b in zip(fp8_linears(loaded.model), fp8_linears(at_load.model)):
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(_prompt_logits(loaded), _prompt_logits(at_load))


def test_a_tensor_scaled_checkpoint_spreads_each_parts_scale_over_its_rows(bf16_checkpoint, fp8_checkpoints):
    path = fp8_checkpoints["tensor"]
    stored = load_file(next(path.glob("*.safetensors")))
    runner = _runner(path, "fp8")  # the flag as well is fine
    attn, mlp = runner.model.layers[0].self_attn, runner.model.layers[0].mlp
    q, k, v = (stored[f"model.layers.0.self_attn.{n}_proj.weight_scale"].item() for n in "qkv")
    assert attn.qkv_proj.weight_scale.tolist() == [q] * 128 + [k] * 64 + [v] * 64
    gate, up = (stored[f"model.layers.0.mlp.{n}_proj.weight_scale"].item() for n in ("gate", "up"))
    assert mlp.gate_up_proj.weight_scale.tolist() == [gate] * 256 + [up] * 256
    down = stored["model.layers.0.mlp.down_proj.weight_scale"].item()
    assert mlp.down_proj.weight_scale.tolist() == [down] * 128
    cosine = F.cosine_similarity(_prompt_logits(_runner(bf16_checkpoint)), _prompt_logits(runner), dim=-1)
    assert cosine.min() >= 0.99  # one scale per matrix is coarser than one per row


def test_a_second_rank_reads_its_own_rows_of_each_scale():
    """q|k|v on rank 1 of 2 with more KV heads than ranks: rows 64..127 of q, 32..63 of k and v."""
    layer = QKVParallelLinear(64, 16, num_heads=8, num_kv_heads=4, bias=False, tp=TPGroup(rank=1, size=2),
                              dtype=torch.bfloat16)
    layer.hold_fp8_checkpoint()
    channel = torch.arange(128, dtype=torch.float32)[:, None]
    layer.load("weight_scale", 0, channel)
    layer.load("weight_scale", 1, channel[:64] + 1000)
    layer.load("weight_scale", 2, torch.tensor([7.0]))  # per tensor: every row of v
    assert layer.weight_scale.tolist() == list(range(64, 128)) + list(range(1032, 1064)) + [7.0] * 32


# ---- what is refused ------------------------------------------------------------------------

def test_an_unknown_quantization_is_refused(bf16_checkpoint):
    with pytest.raises(ValueError, match="quantization must be one of fp8, got 'int4'"):
        EngineArgs(model=str(bf16_checkpoint), quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization 'awq'; supported: fp8"):
        resolve_quantization("awq", load_model_config(str(bf16_checkpoint)), CPU)


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
    ({"format": "int-quantized"}, "config group 'group_0': format 'int-quantized'"),
    ({"group": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}, "weight strategy 'block'"),
    ({"group": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}, "weights of 4 bits, type 'int'"),
    ({"group": {"input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
     r"static input activation scales \(input_scale tensors, dynamic: false\)"),
    ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore list"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_an_unsupported_checkpoint_quantization_is_refused_naming_what_is_supported(bf16_checkpoint, tmp_path,
                                                                                    change, message):
    qc = _ct_config()
    qc["config_groups"]["group_0"].update(change.pop("group", {}))
    qc.update(change)
    config = json.loads((bf16_checkpoint / "config.json").read_text())
    config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as raised:
        load_model_config(str(tmp_path))
    assert "pagefleet loads compressed-tensors FP8 weights" in str(raised.value)


def test_fp8_configs_with_dynamic_or_no_activation_scales_read_as_fp8():
    assert checkpoint_quantization({}, Path("m")) is None
    assert checkpoint_quantization({"quantization_config": _ct_config("tensor")}, Path("m")) == "fp8"
    weight_only = _ct_config(input_activations=None)
    assert checkpoint_quantization({"quantization_config": weight_only}, Path("m")) == "fp8"
