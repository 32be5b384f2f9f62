"""Config-only checkpoints of the models ``pagefleet plan`` knows by name, for the simulated
engine (``--simulate``): the model's published shape as its config.json and the demo tokenizer,
no weights. ``pagefleet plan`` reads the same shape from the directory as from the name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from pagefleet.worker.simulated.presets import ModelShape, find_model
from pagefleet.worker.simulated.tokenizer import IM_END_TOKEN, build_demo_tokenizer

# Bumped whenever the files written here change, so a stale cached checkpoint is never served.
SIMULATED_FORMAT_VERSION = 2
# The demo's larger tokenizer: a BPE vocabulary whose text is about as dense in tokens as a real
# one's. The config keeps the model's own vocabulary size, which the roofline's LM head reads.
TOKENIZER_VOCAB = 32000  # the demo's small checkpoint's too (cluster/demo/model.py): one tokenizer trained for both


def simulated_checkpoint(model: str) -> str | None:
    """The config-only checkpoint directory of a model known by name (written on first use), or
    None when ``model`` is a directory or no known name."""
    if Path(model).expanduser().is_dir():
        return None
    shape = find_model(model)
    if shape is None:
        return None
    target = demo_cache_root() / f"simulated-{shape.name.lower()}-v{SIMULATED_FORMAT_VERSION}"
    return str(cached_checkpoint(target, lambda out: write_config_checkpoint(shape, out)))


def demo_cache_root() -> Path:
    """Where the demo and simulated checkpoints are written on first use."""
    return Path(os.environ.get("PAGEFLEET_CACHE", Path.home() / ".cache" / "pagefleet")).expanduser()


def cached_checkpoint(target: Path, write: Callable[[Path], object]) -> Path:
    """``target``, written by ``write(directory)`` unless it holds a config.json already.

    Written to a temporary sibling and renamed into place, so concurrent processes (several
    replicas starting at once) never see a half-written directory."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its copy first; theirs is identical.
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def architecture_of(shape: ModelShape) -> tuple[str, str]:
    """(architecture, model_type) whose defaults give the shape's biases and norms when read back."""
    if shape.attention_sinks:
        return "GptOssForCausalLM", "gpt_oss"
    if shape.num_experts:
        return ("Qwen3MoeForCausalLM", "qwen3_moe") if shape.qk_norm else ("MixtralForCausalLM", "mixtral")
    if shape.qk_norm:
        return "Qwen3ForCausalLM", "qwen3"
    if shape.attention_bias:
        return "Qwen2ForCausalLM", "qwen2"
    if shape.name.lower().startswith("mistral"):
        return "MistralForCausalLM", "mistral"
    return "LlamaForCausalLM", "llama"


def write_config_checkpoint(shape: ModelShape, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer(min(shape.vocab_size, TOKENIZER_VOCAB), shape.max_position_embeddings)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    arch, model_type = architecture_of(shape)
    config = {
        "architectures": [arch], "model_type": model_type, "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings, "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": shape.attention_bias, "mlp_bias": shape.mlp_bias, "sliding_window": None,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "dtype": shape.dtype,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id,
    }
    config.update(_moe_config(shape, arch))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tokenizer.bos_token_id,
                                                            "eos_token_id": eos}, indent=2))
    tokenizer.save_pretrained(out)
    return out


def _moe_config(shape: ModelShape, arch: str) -> dict:
    """The mixture-of-experts and gpt-oss keys of each architecture's config.json ({} if dense).
    Every preset with experts has them in all its layers."""
    if not shape.num_experts:
        return {}
    if shape.num_moe_layers != shape.num_layers:
        raise ValueError(f"{shape.name}: a config-only checkpoint puts experts in every layer")
    if arch == "Qwen3MoeForCausalLM":
        return {"num_experts": shape.num_experts, "num_experts_per_tok": shape.num_experts_per_tok,
                "moe_intermediate_size": shape.moe_intermediate_size, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True}
    config = {"num_local_experts": shape.num_experts, "num_experts_per_tok": shape.num_experts_per_tok}
    if arch == "GptOssForCausalLM":
        windows = set(shape.sliding_windows) - {None}
        config.update(experts_per_token=shape.num_experts_per_tok, swiglu_limit=7.0, rope_theta=150000.0,
                      sliding_window=max(windows) if windows else None,
                      layer_types=["full_attention" if w is None else "sliding_attention"
                                   for w in shape.sliding_windows or (None,) * shape.num_layers],
                      rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "original_max_position_embeddings": 4096, "truncate": False})
    return config
