"""Model shapes and GPU specs that ``pagefleet plan`` knows by name.

Model numbers are those of each model's published config.json. GPU memory is the total the
CUDA driver reports (``nvidia-smi``, ``torch.cuda.mem_get_info``): what the engine multiplies
by ``gpu_memory_utilization``. Bandwidth and 16-bit dense tensor throughput are the vendors'
peak figures for the SXM (or only) form factor.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizing needs from a decoder's config.json."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int  # the longest max_model_len pagefleet accepts for it
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v biases
    mlp_bias: bool = False
    qk_norm: bool = False         # Qwen3: per-head q/k RMSNorm weights
    dtype: str = "bfloat16"
    # Mixture of experts: experts per MoE layer, experts a token runs, each expert's intermediate
    # size, and how many layers have experts (the rest a dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    # gpt-oss: biases on the router and every expert, on o_proj, and a sink logit per query head.
    expert_bias: bool = False
    o_proj_bias: bool = False
    attention_sinks: bool = False
    # Each layer's sliding window in tokens, None for full attention; () where no layer slides.
    sliding_windows: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, peak
    flops: float      # 16-bit dense tensor FLOP/s, peak


MODELS: dict[str, ModelShape] = {m.name.lower(): m for m in (
    ModelShape("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8, 128, 8192),
    ModelShape("Llama-3-70B", 128256, 8192, 28672, 80, 64, 8, 128, 8192),
    ModelShape("Llama-3.1-8B", 128256, 4096, 14336, 32, 32, 8, 128, 131072),
    ModelShape("Llama-3.1-70B", 128256, 8192, 28672, 80, 64, 8, 128, 131072),
    ModelShape("Llama-3.1-405B", 128256, 16384, 53248, 126, 128, 8, 128, 131072),
    ModelShape("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, 128, 32768, attention_bias=True),
    ModelShape("Qwen2.5-72B", 152064, 8192, 29568, 80, 64, 8, 128, 32768, attention_bias=True),
    ModelShape("Qwen3-8B", 151936, 4096, 12288, 36, 32, 8, 128, 40960, qk_norm=True),
    ModelShape("Qwen3-32B", 151936, 5120, 25600, 64, 64, 8, 128, 40960, qk_norm=True),
    # v0.3: 32768-token vocabulary and no sliding window (v0.1 had a 4096-token one in every
    # layer: plan its checkpoint directory, whose window caps the KV a sequence holds).
    ModelShape("Mistral-7B-v0.3", 32768, 4096, 14336, 32, 32, 8, 128, 32768),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 local experts of intermediate 14336, top 2, in all
    # 32 layers; "sliding_window": null.
    ModelShape("Mixtral-8x7B-v0.1", 32000, 4096, 14336, 32, 32, 8, 128, 32768, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=14336, num_moe_layers=32),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of moe_intermediate_size 768, top 8,
    # decoder_sparse_step 1 and no mlp_only_layers (every layer has experts; intermediate_size 6144
    # names no layer's MLP), use_sliding_window false.
    ModelShape("Qwen3-30B-A3B", 151936, 2048, 6144, 48, 32, 4, 128, 40960, qk_norm=True, num_experts=128,
               num_experts_per_tok=8, moe_intermediate_size=768, num_moe_layers=48),
    # openai/gpt-oss-20b config.json: 32 local experts of intermediate 2880, top 4, in all 24
    # layers; attention_bias (q/k/v and o_proj), sinks, a 128-token window in the even layers
    # (layer_types alternates sliding, full), YaRN rope (factor 32 over 4096). Its experts ship in
    # MXFP4; the engine dequantizes them to bfloat16 as they load, so they are sized at 16 bits.
    ModelShape("gpt-oss-20b", 201088, 2880, 2880, 24, 64, 8, 64, 131072, attention_bias=True, num_experts=32,
               num_experts_per_tok=4, moe_intermediate_size=2880, num_moe_layers=24, expert_bias=True,
               o_proj_bias=True, attention_sinks=True, sliding_windows=(128, None) * 12),
)}
MODEL_ALIASES = {"mistral-7b": "mistral-7b-v0.3", "mixtral-8x7b": "mixtral-8x7b-v0.1"}

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM 80GB", 81559 * MiB, 3.35e12, 989e12),
    "h200": GPUSpec("H200 141GB", 143771 * MiB, 4.8e12, 989e12),
    "a100-80gb": GPUSpec("A100 SXM 80GB", 81920 * MiB, 2.039e12, 312e12),
    "a100-40gb": GPUSpec("A100 SXM 40GB", 40960 * MiB, 1.555e12, 312e12),
    "l40s": GPUSpec("L40S 48GB", 46068 * MiB, 0.864e12, 362e12),
    "l4": GPUSpec("L4 24GB", 23034 * MiB, 0.3e12, 121e12),
}


def find_model(name: str) -> ModelShape | None:
    """A preset by name, case-insensitive; a Hugging Face id's last part also matches
    (``meta-llama/Meta-Llama-3-8B`` -> Llama-3-8B). None when unknown."""
    key = name.lower().rsplit("/", 1)[-1].removeprefix("meta-").removesuffix("-instruct")
    key = MODEL_ALIASES.get(key, key)
    return MODELS.get(key)


def find_gpu(name: str) -> GPUSpec:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory and --gpu-bandwidth)")
    return GPUS[key]
