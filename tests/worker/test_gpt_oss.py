"""gpt-oss equals transformers: a tiny random-weight GptOssForCausalLM (demo arch gpt_oss: a
sliding layer then a full one, attention sinks, q/k/v/o biases, 4 experts with biases and the
clamped SwiGLU, YaRN rope) loaded from its safetensors through the engine's own loader, on
prompts longer than its 24-token window, with prefix-cache hits, chunked prefill, preemption
and the Triton kernels on the interpreter; then the same experts stored in MXFP4.

Greedy tokens exactly; each chosen token's logprob against transformers' full forward pass
within 1e-4 (fp32; sums in other orders: a few ulps of logits of order 10, as in
test_sliding_window_engine). The sinks zeroed, the two layers' windows swapped, or gate and up
swapped each move these logprobs by more than 1e-2 on this checkpoint (checked; the demo's init makes
attention, sinks and routing O(1)).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.kernels.reference import build_cos_sin_cache
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.model_executor.model_config import load_model_config

from hf_reference import hf_greedy, hf_model

WINDOW = 24
MAX_NEW = 24


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint):
    return tiny_checkpoint("gpt_oss", sliding_window=WINDOW)


def prompts_for(tokenizer) -> list[list[int]]:
    """Prompts of 2 to ~70 tokens; the last two share a 48-token (three-block) prefix."""
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog and runs " * 8)[:48]
    texts = ["a much longer prompt about serving language models from a cluster of machines " * 3, "short one",
             "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [shared + tokenizer.encode(s) for s in ("alpha beta", "gamma delta epsilon")]
    return prompts


def generate(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def full_forward_logprobs(checkpoint, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(str(checkpoint))(input_ids=ids).logits[0].float()
    logprobs = logits[len(prompt) - 1:-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def assert_equal_to_transformers(checkpoint, prompts, outs, what, reference=None):
    """``reference``: the checkpoint transformers runs (default: ``checkpoint`` itself)."""
    reference = reference or checkpoint
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, _ = hf_greedy(str(reference), tuple(prompt), MAX_NEW)
        assert out.token_ids == ref, f"{what}: prompt {i} ({len(prompt)} tokens)"
        ours = [lp.logprob for lp in out.logprobs]
        assert ours == pytest.approx(full_forward_logprobs(reference, prompt, ref), abs=1e-4), f"{what}: prompt {i}"


def test_config_reads_gpt_oss(gpt_oss):
    cfg = load_model_config(str(gpt_oss))
    assert cfg.architecture == "GptOssForCausalLM"
    assert cfg.sliding_windows == (WINDOW, None) and cfg.kv_sliding_window is None  # a full layer keeps all KV
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers) == (4, 2, 96, (0, 1))
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias and not cfg.mxfp4_experts
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (0.25, 1.702)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0


def test_yarn_cos_sin_equal_transformers(gpt_oss):
    rotary = hf_model(str(gpt_oss)).model.rotary_emb
    positions = torch.arange(0, 2048, 7)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cfg = load_model_config(str(gpt_oss))
    ours = build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    assert rotary.attention_scaling != 1.0  # YaRN's factor on cos and sin is in play
    assert torch.equal(ours[positions], torch.cat((cos[0], sin[0]), dim=-1))


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cpu-decode-kernel", "twin"])
def test_past_the_window_with_prefix_hits_matches_transformers(gpt_oss, enforce_eager):
    llm = LLM(model=str(gpt_oss), dtype="float32", kv_cache_bytes=32 << 20, enforce_eager=enforce_eager)
    prompts = prompts_for(llm.tokenizer)
    assert max(map(len, prompts)) > 2 * WINDOW and min(map(len, prompts)) < WINDOW
    assert_equal_to_transformers(gpt_oss, prompts, generate(llm, prompts), "batch")
    hits = llm.engine.stats().prefix_cache_hits
    assert_equal_to_transformers(gpt_oss, prompts, generate(llm, prompts), "prefix-cached rerun")
    assert llm.engine.stats().prefix_cache_hits - hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_chunked_prefill_and_preemption_match_transformers(gpt_oss):
    cfg = load_model_config(str(gpt_oss))
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    # 7-token chunks cross the window; 16 blocks cannot hold every sequence: preemption by recompute.
    llm = LLM(model=str(gpt_oss), dtype="float32", kv_cache_bytes=16 * per_block, max_num_batched_tokens=7,
              enable_prefix_caching=False, max_model_len=256)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_transformers(gpt_oss, prompts, generate(llm, prompts), "chunked prefill, preempted")
    assert llm.engine.stats().num_preemptions > 0


def test_triton_kernels_on_the_interpreter_match_transformers(gpt_oss, monkeypatch):
    pytest.importorskip("triton")
    from pagefleet.kernels import ops
    from pagefleet.kernels.triton_kernel import TritonKernel

    launches = Counter()
    real_on = TritonKernel.on

    def counting_on(self, device):
        launches[self.__name__] += 1
        return real_on(self, device)

    monkeypatch.setattr(TritonKernel, "on", counting_on)
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    llm = LLM(model=str(gpt_oss), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_num_batched_tokens=16)
    prompts = prompts_for(llm.tokenizer)[3:]  # two 50-token prompts with a shared 48-token prefix
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params)
    assert second[0].num_cached_tokens == 48
    for prompt, out in zip(prompts, first + second):
        assert out.outputs[0].token_ids == hf_greedy(str(gpt_oss), tuple(prompt), 6)[0]
    assert launches["_paged_attention_kernel"] > 0


# ---- MXFP4 experts

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8, the
    values they stand for [..., K] fp32): per 32-value group the power of two that brings its
    largest magnitude to at most 6, each value rounded to the nearest FP4 code (the low nibble
    holds the even element)."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - FP4).abs().argmin(-1)  # [..., G, 32] nearest code (0.0 before -0.0)
    values = FP4[codes] * torch.exp2(exponent)[..., None]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (exponent + 127).to(torch.uint8), values.flatten(-2)


@pytest.fixture(scope="module")
def mxfp4_pair(gpt_oss, tmp_path_factory):
    """(an MXFP4 copy of the checkpoint, a full-precision copy holding exactly its dequantized
    experts): transformers runs the second, pagefleet loads the first."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    mx, plain = root / "mxfp4", root / "plain"
    shutil.copytree(gpt_oss, mx)
    shutil.copytree(gpt_oss, plain)
    (file,) = mx.glob("*.safetensors")
    tensors = load_file(file)
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # Stored transposed ([E, H, 2I], [E, I, H]); MXFP4 groups run along the input dimension.
            blocks, scales, values = quantize_mxfp4(t.transpose(1, 2))
            assert not torch.equal(values, t.transpose(1, 2))  # rounding to FP4 really changed the weights
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = values.transpose(1, 2).contiguous()
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, mx / file.name, metadata={"format": "pt"})
    save_file(dequantized, plain / file.name, metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(config))
    return mx, plain, dequantized


def test_mxfp4_experts_load_dequantized_exactly(mxfp4_pair, caplog):
    mx, _, dequantized = mxfp4_pair
    with caplog.at_level(logging.INFO, logger="pagefleet.worker.model_executor.loader"):
        llm = LLM(model=str(mx), dtype="float32", kv_cache_bytes=8 << 20)
    assert load_model_config(str(mx)).mxfp4_experts
    lines = [r.getMessage() for r in caplog.records if "MXFP4" in r.getMessage()]
    assert lines == [(f"{mx.name} stores its experts in MXFP4; pagefleet has no MXFP4 kernel for cpu, so they are "
                      "dequantized to float32 as they load")]
    model = llm.engine.executor.runner.model
    for i, layer in enumerate(model.layers):
        gate_up = dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H] interleaved
        down = dequantized[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2)  # [E, H, I]
        assert torch.equal(layer.mlp.experts.w13, torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
        assert torch.equal(layer.mlp.experts.w2, down)


def test_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(mxfp4_pair):
    mx, plain, _ = mxfp4_pair
    llm = LLM(model=str(mx), dtype="float32", kv_cache_bytes=32 << 20)
    prompts = prompts_for(llm.tokenizer)
    assert_equal_to_transformers(mx, prompts, generate(llm, prompts), "mxfp4", reference=plain)


@pytest.mark.parametrize("rank", [0, 1])
def test_mxfp4_experts_shard_over_two_ranks(rank):
    from pagefleet.worker.model_executor.moe import GptOssExperts
    from pagefleet.worker.parallel.tp_group import TPGroup

    experts, hidden, inter = 3, 64, 64  # each rank: 32 of the 64 intermediate rows
    gen = torch.Generator().manual_seed(rank)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)  # [E, 2I, H], gate/up interleaved
    down = torch.randn(experts, hidden, inter, generator=gen)
    gu_blocks, gu_scales, gu_values = quantize_mxfp4(gate_up)
    d_blocks, d_scales, d_values = quantize_mxfp4(down)
    layer = GptOssExperts(experts, hidden, inter, TPGroup(rank=rank, size=2), torch.float32)
    # Scales before blocks for gate_up, blocks before scales for down: either order pairs up.
    layer.load("w13", 2, gu_scales)
    layer.load("w13", 1, gu_blocks)
    layer.load("w2", 1, d_blocks)
    layer.load("w2", 2, d_scales)
    mine = slice(32 * rank, 32 * (rank + 1))
    assert torch.equal(layer.w13, torch.cat((gu_values[:, 0::2][:, mine], gu_values[:, 1::2][:, mine]), dim=1))
    assert torch.equal(layer.w2, d_values[:, :, mine])


def test_mxfp4_is_read_for_gpt_oss_only(tmp_path):
    from pagefleet.worker.model_executor.compressed_tensors import checkpoint_quantization

    mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}}
    assert checkpoint_quantization({**mxfp4, "model_type": "gpt_oss"}, tmp_path) is None
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is not supported"):
        checkpoint_quantization({**mxfp4, "model_type": "llama"}, tmp_path)


def test_a_released_style_config_reads_as_transformers_reads_it(tmp_path):
    """gpt-oss-20b's shape as its config.json gives it (rope_scaling of type yarn with truncate false,
    rope_theta at the top, MXFP4 quantization_config, no swiglu_alpha): our fields and YaRN table
    against transformers' GptOssConfig and rotary embedding on the same dictionary."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    fields = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
              "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
              "num_key_value_heads": 8, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
              "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "rope_theta": 150000,
              "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings":
                               4096, "rope_type": "yarn", "truncate": False},
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    cfg = load_model_config(str(tmp_path))
    assert cfg.sliding_windows == (128, None) * 12 and cfg.mxfp4_experts and cfg.quantization is None
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.dtype) == (7.0, 1.702, torch.bfloat16)
    rotary = GptOssRotaryEmbedding(GptOssConfig(**{k: v for k, v in fields.items() if k != "quantization_config"}))
    positions = torch.tensor([0, 1, 127, 4095, 4096, 65537, 131071])
    cos, sin = rotary(torch.zeros(1), positions[None])
    ours = build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours[positions], torch.cat((cos[0], sin[0]), dim=-1))
