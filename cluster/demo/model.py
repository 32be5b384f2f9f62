"""Deterministic random-weight Hugging Face checkpoints for demos, tests and benchmarks.

A checkpoint written here is a normal Hugging Face model directory
(config.json, safetensors weights, generation_config.json, a byte-level BPE
tokenizer with a ChatML chat template) that `AutoModelForCausalLM` and
`AutoTokenizer` load offline. Nothing is downloaded: the tokenizer is trained
in-process on a synthetic corpus built from a fixed seed, and the weights are
drawn from a seeded generator, so the same arguments give byte-identical files
on any machine with the same package versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagefleet.worker.model_executor.model_config import DTYPES
from pagefleet.worker.simulated.checkpoint import cached_checkpoint, demo_cache_root
from pagefleet.worker.simulated.tokenizer import IM_END_TOKEN, build_demo_tokenizer

if TYPE_CHECKING:
    import torch

    from pagefleet.worker.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# Bumped whenever the files written here change, so a stale cached demo
# checkpoint is never served.
DEMO_FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True)
class DemoSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


DEMO_SIZES = {
    "tiny": DemoSize(128, 2, 4, 2, 256, 1000, 2048),
    "small": DemoSize(512, 8, 8, 4, 1408, 32000, 4096),
}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt_oss")
# The mixture-of-experts demos: 4 experts, 2 a token; Qwen3-MoE's second layer is dense
# (mlp_only_layers), so one model has both kinds of layer.
_MOE_KWARGS = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
               "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                             "mlp_only_layers": [1], "norm_topk_prob": True},
               # gpt-oss: sliding then full layers (its default layer_types), YaRN rope whose ramp falls
               # inside the tiny head_dim, and a SwiGLU limit low enough that the clamp bites on
               # these small random weights.
               "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
                           "sliding_window": 128, "swiglu_limit": 0.25,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 256}}}

# Fixed text mixed into the synthetic corpus so that digits, punctuation, code
# and common English words get merges of their own.
def _model_config(arch: str, size: DemoSize, *, vocab_size: int, num_key_value_heads: int,
                  tie_word_embeddings: bool | None, dtype: str, token_ids: dict[str, int],
                  sliding_window: int | None = None, max_window_layers: int | None = None):
    from transformers import (
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
                    "mixtral": MixtralConfig, "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig}[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        # Qwen3Config defaults head_dim to 128 whatever the hidden size is.
        head_dim=size.hidden_size // size.num_attention_heads,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
    )
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    if arch == "qwen2":
        # Qwen2Config has no head_dim field; its head_dim is hidden // heads anyway.
        del kwargs["head_dim"]
    if arch == "mistral":
        # Mistral v0.2+ checkpoints ship without a sliding window.
        kwargs["sliding_window"] = None
    kwargs.update(_MOE_KWARGS.get(arch, {}))
    kwargs.update(_window_kwargs(arch, sliding_window, max_window_layers))
    import torch

    config = config_class(**kwargs)
    config.dtype = getattr(torch, dtype)
    return config


def _window_kwargs(arch: str, sliding_window: int | None, max_window_layers: int | None) -> dict:
    """The config fields of a sliding window: every layer's for Mistral and Mixtral; for Qwen2 and
    Qwen3 the layers from max_window_layers on (0 when not given: all of them)."""
    if sliding_window is None:
        if max_window_layers is not None:
            raise ValueError("max_window_layers needs a sliding_window")
        return {}
    if arch in ("mistral", "mixtral", "gpt_oss"):
        if max_window_layers is not None:
            raise ValueError(f"{arch} slides in every layer: it has no max_window_layers")
        return {"sliding_window": sliding_window}
    if arch in ("qwen2", "qwen3"):
        return {"use_sliding_window": True, "sliding_window": sliding_window,
                "max_window_layers": max_window_layers or 0}
    raise ValueError(f"the {arch} demo has no sliding window")


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded init that does not depend on transformers' init order.

    Plain N(0, 0.02) everywhere (as transformers does) makes a random model
    whose residual stream is dominated by a near-uniform average over the
    context, so greedy decoding repeats itself and barely depends on position.
    Instead: q_proj/k_proj std 1/sqrt(hidden) so attention logits are O(1)
    (attention depends on content and rope position, so engine tests catch KV
    cache and position bugs); o_proj/down_proj std 0.02/sqrt(2 * layers) as in
    GPT-2's scaled residual init; embeddings std 0.05 so the current token
    weighs as much as its context. Norm weights are 1, other matrices and
    biases N(0, 0.02). Checked: greedy outputs on random prompts rarely repeat
    a token and change when the first prompt token changes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden_size = model.config.hidden_size
    residual_std = 0.02 / (2 * model.config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            std = 0.02
            # A MoE router's logits O(1) too, so that each token's top-k is no near-tie.
            if name.endswith(("q_proj.weight", "k_proj.weight", "mlp.gate.weight", "block_sparse_moe.gate.weight",
                              "mlp.router.weight")):
                std = hidden_size ** -0.5
            elif name.endswith("self_attn.sinks"):
                std = 1.0  # gpt-oss's sink logits, of the scores' order, so that they take a real share
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                std = residual_std
            elif name.endswith("embed_tokens.weight"):
                std = 0.05
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)


def _max_shard_size_for(state_dict: dict[str, torch.Tensor], num_shards: int) -> int:
    """Smallest byte size for which Hugging Face's greedy in-order sharding makes
    exactly `num_shards` files (the shard count only falls as the size grows)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(max_size: int) -> int:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_size)
        return len(split.filename_to_tensors)

    sizes = [t.numel() * t.element_size() for t in state_dict.values()]
    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if count(middle) <= num_shards:
            high = middle
        else:
            low = middle + 1
    if count(low) != num_shards:
        raise ValueError(f"cannot split this checkpoint into exactly {num_shards} shards")
    return low


@contextlib.contextmanager
def _progress_bars_disabled():
    """Silence transformers' per-shard progress bar, restoring the caller's setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def write_demo_checkpoint(
    out_dir: str | os.PathLike,
    *,
    size: str = "tiny",
    arch: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    num_shards: int = 1,
    tie_word_embeddings: bool | None = None,
    vocab_size: int | None = None,
    num_key_value_heads: int | None = None,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
) -> Path:
    """Write a random-weight checkpoint to `out_dir` (created if needed) and return its path.

    `tie_word_embeddings=None` keeps the architecture's default (untied for all
    four); `vocab_size` and `num_key_value_heads` override the size preset.
    `sliding_window` gives Mistral and Mixtral a window in every layer, gpt-oss one in its sliding layers, Qwen2 and Qwen3 one in
    the layers from `max_window_layers` on."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size not in DEMO_SIZES:
        raise ValueError(f"size must be one of {sorted(DEMO_SIZES)}, got {size!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {list(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    preset = DEMO_SIZES[size]
    vocab_size = preset.vocab_size if vocab_size is None else vocab_size
    num_kv_heads = preset.num_key_value_heads if num_key_value_heads is None else num_key_value_heads
    if num_kv_heads < 1 or preset.num_attention_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_key_value_heads must divide num_attention_heads={preset.num_attention_heads}, got {num_kv_heads}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer(vocab_size, DEMO_SIZES["small"].max_position_embeddings)
    token_ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = _model_config(arch, preset, vocab_size=vocab_size, num_key_value_heads=num_kv_heads,
                           tie_word_embeddings=tie_word_embeddings, dtype=dtype, token_ids=token_ids,
                           sliding_window=sliding_window, max_window_layers=max_window_layers)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["bos"],
        # A chat turn ends at <|im_end|>; plain text ends at <|end_of_text|>.
        eos_token_id=[token_ids["eos"], tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=token_ids["pad"],
    )
    save_kwargs = {}
    if num_shards > 1:
        state_dict = {name: t for name, t in model.state_dict().items()
                      if not (config.tie_word_embeddings and name == "lm_head.weight")}
        save_kwargs["max_shard_size"] = _max_shard_size_for(state_dict, num_shards)
    with _progress_bars_disabled():
        model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(out)

    num_written = len(list(out.glob("*.safetensors")))
    if num_written != num_shards:
        raise RuntimeError(f"wrote {num_written} safetensors files, expected {num_shards}")
    return out


def default_demo_model_dir() -> Path:
    """The built-in demo checkpoint (tiny Llama, random weights), written on first use."""
    target = demo_cache_root() / f"demo-tiny-llama-v{DEMO_FORMAT_VERSION}"
    return cached_checkpoint(target, lambda out: write_demo_checkpoint(out, size="tiny", arch="llama"))


def or_demo_model(args: "EngineArgs") -> "EngineArgs":
    """``args``, serving the built-in demo checkpoint (written on first use) when no model is given."""
    if args.model is not None:
        return args
    path = default_demo_model_dir()
    logger.warning("no model given: serving the built-in demo checkpoint at %s (RANDOM WEIGHTS, its text is "
                   "noise; pass a checkpoint directory to serve a real model)", path)
    return dataclasses.replace(args, model=str(path))
