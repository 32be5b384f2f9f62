"""Which quantization a checkpoint's config.json declares, of the layouts pagefleet loads as they are.

One layout is supported: compressed-tensors FP8 weights ("float-quantized": 8-bit float weights
with per-channel or per-tensor scales, activations quantized per token at run time; what
llm-compressor's FP8_DYNAMIC scheme writes). Every linear layer of the decoder is quantized and
lm_head is not. Anything else is refused at start with what is supported, rather than loaded wrong.
"""

from __future__ import annotations

from pathlib import Path

SUPPORTED = ("compressed-tensors FP8 weights (format float-quantized: 8-bit float weights, channel or tensor "
             "strategy, symmetric; input activations dynamic per token or absent; targets Linear; "
             "only lm_head ignored)")
_WEIGHT_STRATEGIES = ("channel", "tensor")


def checkpoint_quantization(config: dict, path: Path) -> str | None:
    """``"fp8"`` for a compressed-tensors FP8 checkpoint, None for an unquantized one; raises
    ValueError for any other quantization_config (config: the parsed config.json of ``path``)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: dequantized as they load (moe.py), the rest full precision
    if method != "compressed-tensors":
        raise ValueError(f"{path}: quantization_config quant_method {method!r} is not supported; "
                         f"pagefleet loads {SUPPORTED}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{path}: compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        problem = _group_problem(group, qc.get("format"))
        if problem:
            raise ValueError(f"{path}: compressed-tensors config group {name!r}: {problem}; "
                             f"pagefleet loads {SUPPORTED}")
    ignored = [entry for entry in qc.get("ignore") or [] if not str(entry).endswith("lm_head")]
    if ignored:
        raise ValueError(f"{path}: compressed-tensors ignore list {ignored}: only lm_head may stay unquantized; "
                         f"pagefleet loads {SUPPORTED}")
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{path}: compressed-tensors kv_cache_scheme (a quantized KV cache with calibrated "
                         f"scales) is not supported; pagefleet loads {SUPPORTED}")
    return "fp8"


def _group_problem(group: dict, top_format: str | None) -> str | None:
    """What in one config group pagefleet cannot load, or None."""
    fmt = group.get("format") or top_format
    if fmt != "float-quantized":
        return f"format {fmt!r}"
    if group.get("targets") != ["Linear"]:
        return f"targets {group.get('targets')!r}"
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        return f"weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}"
    if weights.get("strategy") not in _WEIGHT_STRATEGIES:
        return f"weight strategy {weights.get('strategy')!r}"
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        return "asymmetric or dynamic weight scales"
    acts = group.get("input_activations")
    if acts:
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            return f"input activations of {acts.get('num_bits')} bits, type {acts.get('type')!r}"
        if not acts.get("dynamic", False):
            # Static scales come as input_scale tensors calibrated offline; the FP8 path here
            # computes every token's scale at run time and has nowhere to use them.
            return "static input activation scales (input_scale tensors, dynamic: false)"
    if group.get("output_activations"):
        return "quantized output activations"
    return None
