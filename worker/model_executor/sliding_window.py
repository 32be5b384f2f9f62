"""Which layers of a checkpoint attend over a sliding window, read from its config.json.

A layer with window W lets the query at position p see the keys at positions p - W + 1 .. p
(W keys, its own included), as transformers' sliding-window mask does (``kv_idx > q_idx - W``).
"""

from __future__ import annotations

# Mistral and Mixtral slide in every layer whenever config.json names a window.
_ALL_LAYERS = ("MistralForCausalLM", "MixtralForCausalLM")
# Qwen2 and Qwen3 slide only with use_sliding_window, in the layers ``layer_types`` names
# (transformers writes it; without it, the layers from max_window_layers on slide).
_BY_LAYER_TYPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Qwen3-MoE slides in every layer with use_sliding_window (transformers reads no layer types for it).
_ALL_LAYERS_IF_USED = ("Qwen3MoeForCausalLM",)
# gpt-oss alternates sliding and full layers by ``layer_types``; transformers' default slides in
# the even layers.
_ALTERNATING = ("GptOssForCausalLM",)
_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default
_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_windows(arch: str, cfg: dict) -> tuple[int | None, ...]:
    """Each layer's window in tokens (None: full attention); () where no layer slides."""
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if arch in _BY_LAYER_TYPE + _ALL_LAYERS_IF_USED and not cfg.get("use_sliding_window", False):
        window = None
    if arch not in _ALL_LAYERS + _BY_LAYER_TYPE + _ALL_LAYERS_IF_USED + _ALTERNATING or window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
    if arch not in _BY_LAYER_TYPE + _ALTERNATING:
        return (window,) * num_layers
    types = cfg.get("layer_types")
    if types is None and arch in _ALTERNATING:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if types is None:
        first = int(cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must name {num_layers} layers, each one of {', '.join(_LAYER_TYPES)}; "
                         f"got {types!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def kv_sliding_window(windows: tuple[int | None, ...]) -> int | None:
    """The window the KV cache may forget by: the widest, when every layer slides (a full-attention
    layer needs every block); None otherwise."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
