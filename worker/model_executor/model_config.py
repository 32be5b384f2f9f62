"""What the engine needs to know about a checkpoint, read from its config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagefleet.worker.model_executor.compressed_tensors import checkpoint_quantization
from pagefleet.worker.model_executor.sliding_window import kv_sliding_window, sliding_windows

if TYPE_CHECKING:
    import torch

    from pagefleet.worker.engine_args import EngineArgs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)  # EngineArgs.quantization (quantization.py)
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


@dataclass(slots=True)
class ModelConfig:
    path: Path
    architecture: str
    served_model_names: tuple[str, ...]  # what /v1/models lists; the first is the name responses and metrics give
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    # The checkpoint directory as --model named it (as given, and absolute) when no name was chosen:
    # vLLM serves a local model under that argument, so its clients send it. Accepted, never listed.
    model_path_names: tuple[str, ...] = ()
    # The checkpoint's own quantization: "fp8" where its weights are stored in FP8
    # (compressed_tensors.py), None for full-precision weights.
    quantization: str | None = None
    # Mixture of experts (moe.py): experts, experts per token, each expert's intermediate size,
    # whether the top-k weights are renormalized, and which layers have experts (the others a
    # dense MLP of intermediate_size). 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Each layer's sliding window in tokens, None for a full-attention layer (sliding_window.py);
    # () where every layer attends over the whole context.
    sliding_windows: tuple[int | None, ...] = ()
    # gpt-oss: a learned sink logit per query head in every attention layer, a bias on o_proj
    # too, and experts with biases and a clamped SwiGLU (swiglu_limit set; None: plain SwiGLU),
    # stored in MXFP4 in the released checkpoints (mxfp4_experts: dequantized as they load).
    attention_sinks: bool = False
    o_proj_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mxfp4_experts: bool = False

    def sliding_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in tokens, None for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def kv_sliding_window(self) -> int | None:
        """The window past which the KV cache frees blocks: set only when every layer slides."""
        return kv_sliding_window(self.sliding_windows)

    @property
    def active_parameters_per_token(self) -> int:
        """Weights one token's forward pass uses (the decode roofline's, not the memory's): the
        planner's own count (``simulated/sizing.py``), so the two cannot disagree."""
        from pagefleet.worker.simulated.sizing import active_params_per_token, model_shape_of

        return active_params_per_token(model_shape_of(self))

    @property
    def num_parameters(self) -> int:
        from pagefleet.worker.simulated.sizing import model_shape_of, num_params

        return num_params(model_shape_of(self))

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


def model_config_of(args: "EngineArgs") -> ModelConfig:
    """The ModelConfig an engine with these options serves (the ingress and the CLI read the same)."""
    if args.model is None:
        raise ValueError("no model given: pass a checkpoint directory (`pagefleet serve` without --model "
                         "serves the built-in demo checkpoint; `pagefleet demo-model --out DIR` writes one)")
    model, names = args.model, args.served_model_name
    if args.simulate is not None:
        # A model `pagefleet plan` knows by name is simulated from its config alone, served under that name.
        from pagefleet.worker.simulated.checkpoint import simulated_checkpoint

        path = simulated_checkpoint(model)
        if path is not None:
            model, names = path, names or [args.model]
    return load_model_config(model, dtype=args.dtype, max_model_len=args.max_model_len, served_model_name=names)


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory; a hub id fails clearly, since nothing is ever downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path
    hub_cache = _find_in_hub_cache(model)
    if hub_cache is not None:
        return hub_cache
    raise FileNotFoundError(
        f"model {model!r} is not a local directory and is not in the local Hugging Face cache; "
        "pagefleet does not download models. Download it first (e.g. `huggingface-cli download "
        f"{model} --local-dir DIR`) and pass --model DIR."
    )


def _find_in_hub_cache(model_id: str) -> Path | None:
    if model_id.count("/") != 1:
        return None
    root = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = root.expanduser() / f"models--{model_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates = sorted((p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                        key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def _read_generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def load_model_config(model: str, *, dtype: str = "auto", max_model_len: int | None = None,
                      served_model_name: str | list[str] | None = None) -> ModelConfig:
    path = resolve_model_path(model)
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}; "
            f"pagefleet supports {', '.join(SUPPORTED_ARCHITECTURES)} (no remote code is run)"
        )
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_scaling = cfg.get("rope_scaling") or None
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    limit = max_pos
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens")
    eos = _read_generation_eos(path)
    cfg_eos = cfg.get("eos_token_id")
    if not eos and cfg_eos is not None:
        eos = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos)
    local = Path(model).expanduser().is_dir()
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    names = tuple(served_model_name or [path.name if local else model])
    path_names = () if served_model_name or not local else _path_names(model, path, names)
    return ModelConfig(
        path=path,
        architecture=arch,
        served_model_names=names,
        model_path_names=path_names,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        max_model_len=max_model_len,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch in ("Qwen2ForCausalLM", "GptOssForCausalLM"))),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        dtype=resolve_dtype(dtype, cfg),
        eos_token_ids=tuple(eos),
        quantization=checkpoint_quantization(cfg, path),
        sliding_windows=sliding_windows(arch, cfg),
        **moe_fields(arch, cfg),
        **gpt_oss_fields(arch, cfg),
    )


def _path_names(model: str, path: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """The --model argument as given and the directory's absolute path, less the served names."""
    found = dict.fromkeys((model, str(path.resolve())))
    return tuple(n for n in found if n not in names)


def parse_dtype(name: str) -> str:
    """``"auto"`` or a canonical dtype name (float32, bfloat16, float16) from any accepted spelling."""
    name = str(name).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of auto, {', '.join(DTYPES)} "
                         f"(or {', '.join(_DTYPE_ALIASES)})")
    return name


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: "torch.dtype") -> "torch.dtype":
    """The KV cache's torch dtype for ``EngineArgs.kv_cache_dtype``: the model's for ``"auto"``,
    float8_e4m3fn for ``"fp8"`` / ``"fp8_e4m3"``."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; use auto, fp8 or fp8_e4m3")


def moe_fields(arch: str, cfg: dict) -> dict:
    """The ModelConfig fields of a mixture-of-experts config.json ({} for a dense model)."""
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        experts, size, norm, layers = cfg["num_local_experts"], cfg["intermediate_size"], True, None
    elif arch == "Qwen3MoeForCausalLM":
        # Released checkpoints say num_experts; transformers 5 writes its alias num_local_experts.
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        size, norm = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", True))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense and experts > 0 and (i + 1) % step == 0)
    else:
        return {}
    top_k = int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not between 1 and the {experts} experts")
    return {"num_experts": int(experts), "num_experts_per_tok": top_k, "moe_intermediate_size": int(size),
            "norm_topk_prob": norm,
            "moe_layers": tuple(range(cfg["num_hidden_layers"])) if layers is None else layers}


def gpt_oss_fields(arch: str, cfg: dict) -> dict:
    """The ModelConfig fields only gpt-oss sets ({} for any other architecture)."""
    if arch != "GptOssForCausalLM":
        return {}
    qc = cfg.get("quantization_config") or {}
    return {"attention_sinks": True, "o_proj_bias": bool(cfg.get("attention_bias", True)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)), "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "mxfp4_experts": qc.get("quant_method") == "mxfp4"}


def resolve_dtype(dtype: str, cfg: dict) -> "torch.dtype":
    """The torch dtype the engine runs in: ``dtype``, or the checkpoint's own for ``"auto"``."""
    import torch

    name = parse_dtype(dtype)
    if name == "auto":
        name = parse_dtype(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
    return getattr(torch, name)
