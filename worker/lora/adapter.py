"""A PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked.

Checked at load, each with the reason named: the config is a plain LoRA one (no DoRA, no trained
biases or extra saved modules, no per-module rank or alpha patterns), its rank is at most
``max_lora_rank``, and every tensor targets a q/k/v/o/gate/up/down projection the model has, with
that projection's shape.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# PEFT's target name -> (the merged linear that holds it, its part in that linear's outputs).
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One targeted projection: ``lora_a`` [r, in], ``lora_b`` [out, r], full (unsharded) tensors."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter in host memory: its rank, its scaling (lora_alpha / r, or / sqrt(r) for rsLoRA), and
    its weights by (layer index, PEFT target name)."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], LoRAWeights]

    def nbytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.weights.values())


def read_adapter_config(path: Path, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the adapter at ``path``, or LoRAAdapterError saying what is not served."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"{path}: no adapter_config.json (a PEFT LoRA checkpoint directory is expected)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"{config_file}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{path}: r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{path}: rank {rank} is over max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {"use_dora": bool(config.get("use_dora")),
                   "bias": config.get("bias", "none") not in ("none", None),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    named = [key for key, used in unsupported.items() if used]
    if named:
        raise LoRAAdapterError(f"{path}: {', '.join(named)} set in adapter_config.json; pagefleet serves plain "
                               "LoRA adapters without them")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(name: str, path: str | Path, max_lora_rank: int,
                 shapes: dict[tuple[int, str], tuple[int, int]], dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter at ``path``. ``shapes``: (in, out) features of every projection the
    model can take LoRA on, by (layer, PEFT target name); weights become ``dtype``."""
    path = Path(path)
    rank, scaling = read_adapter_config(path, max_lora_rank)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAAdapterError(f"{path}: no adapter_model.safetensors (pagefleet loads safetensors adapters only)")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, target, part = _parse_key(path, key, shapes)
                found.setdefault((layer, target), {})[part] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # safetensors' own parse errors: a truncated or foreign file
        raise LoRAAdapterError(f"{weights_file}: cannot be read as safetensors: {exc}") from None
    if not found:
        raise LoRAAdapterError(f"{path}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, target), parts in sorted(found.items()):
        if set(parts) != {"A", "B"}:
            raise LoRAAdapterError(f"{path}: layer {layer} {target} has lora_{''.join(parts)} without its pair")
        in_features, out_features = shapes[(layer, target)]
        a, b = parts["A"], parts["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAAdapterError(f"{path}: layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; the model and r={rank} need ({rank}, {in_features}) and "
                                   f"({out_features}, {rank})")
        weights[(layer, target)] = LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoRAAdapter(name, rank, scaling, weights)


def _parse_key(path: Path, key: str, shapes: dict[tuple[int, str], tuple[int, int]]) -> tuple[int, str, str]:
    match = _KEY.fullmatch(key)
    if match is None:
        raise LoRAAdapterError(f"{path}: tensor {key!r} is not a LoRA weight of a decoder layer's projection "
                               f"(pagefleet applies LoRA to {', '.join(TARGETS)})")
    layer, target, part = int(match.group(1)), match.group(3), match.group(4)
    if target not in TARGETS:
        raise LoRAAdapterError(f"{path}: target module {target!r} is not one pagefleet applies LoRA to "
                               f"({', '.join(TARGETS)})")
    if (layer, target) not in shapes:
        raise LoRAAdapterError(f"{path}: targets {target} of layer {layer}, which the model lacks")
    return layer, target, part
