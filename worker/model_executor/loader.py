"""Build the model and fill it from safetensors, each rank reading only its own slices."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pagefleet.kernels.ops import Kernels
from pagefleet.worker.model_executor.model import LlamaForCausalLM
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.quantization import hold_fp8_checkpoint, quantize_fp8
from pagefleet.worker.parallel.tp_group import TPGroup

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path} (pagefleet loads safetensors only)")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def load_model(cfg: ModelConfig, tp: TPGroup, kernels: Kernels, device: torch.device,
               load_format: str = "safetensors", seed: int = 0, quantization: str | None = None) -> LlamaForCausalLM:
    """``quantization``: what ``quantization.resolve_quantization`` decided ("fp8" or None). A
    checkpoint stored in FP8 loads its weights as they are; others are quantized once loaded."""
    with torch.device(device):
        model = LlamaForCausalLM(cfg, tp, kernels, device)
    prequantized = load_format != "dummy" and cfg.quantization == "fp8"
    if prequantized:
        hold_fp8_checkpoint(model)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        started = time.monotonic()
        if cfg.mxfp4_experts and tp.rank == 0:
            logger.info("%s stores its experts in MXFP4; pagefleet has no MXFP4 kernel for %s, so they are "
                        "dequantized to %s as they load", cfg.path.name, torch.device(device).type,
                        str(cfg.dtype).removeprefix("torch."))
        _load_safetensors(model, cfg.path, progress=tp.rank == 0)
        if tp.rank == 0:
            size = sum(p.numel() * p.element_size() for p in model.parameters())
            logger.info("loaded the weights of %s (%.2f GiB on this rank) in %.1f s", cfg.path.name, size / 2**30,
                        time.monotonic() - started)
    if quantization == "fp8" and not prequantized:
        quantize_fp8(model)
    return model.eval()


def _load_safetensors(model: LlamaForCausalLM, path: Path, progress: bool = False) -> None:
    """``progress``: a bar over the shards (rank 0 shows it; the other ranks load the same files)."""
    table = model.modules_by_checkpoint_name()
    expected = {name for name, (module, kind, _) in table.items() if getattr(module, kind, None) is not None}
    loaded: set[str] = set()
    files = checkpoint_files(path)
    for file in tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard", disable=not progress):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and name not in table:
                    continue  # tied embeddings: some checkpoints still carry the copy
                entry = table.get(name)
                if entry is None or name not in expected:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name} for {model.cfg.architecture}")
                module, kind, shard = entry
                module.load(kind, shard, f.get_slice(name))
                loaded.add(name)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights (normal, std 0.02; norms 1), for sizing and speed runs without a checkpoint."""
    gen = torch.Generator(device=model.cos_sin.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
