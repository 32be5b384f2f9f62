"""Which layers slide, read from config.json as transformers reads it: each case is checked
against the layer types transformers' own config class gives the same dictionary."""

from __future__ import annotations

import pytest
from transformers import GptOssConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from pagefleet.worker.model_executor.sliding_window import kv_sliding_window, sliding_windows

CONFIGS = {"MistralForCausalLM": MistralConfig, "MixtralForCausalLM": MixtralConfig,
           "Qwen2ForCausalLM": Qwen2Config, "Qwen3ForCausalLM": Qwen3Config, "Qwen3MoeForCausalLM": Qwen3MoeConfig,
           "GptOssForCausalLM": GptOssConfig}

CASES = [
    # (architecture, config.json fields, each layer's window)
    ("MistralForCausalLM", {"sliding_window": 32}, (32, 32, 32, 32)),
    ("MistralForCausalLM", {"sliding_window": None}, ()),
    ("MixtralForCausalLM", {"sliding_window": 16}, (16, 16, 16, 16)),
    ("Qwen2ForCausalLM", {"sliding_window": 32}, ()),  # use_sliding_window defaults to false
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
     (None, 32, 32, 32)),
    # No max_window_layers: transformers' default of 28 leaves a 4-layer model sliding nowhere.
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 32}, ()),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
     (None, None, None, 8)),
    # layer_types, where given, decides (transformers writes it into config.json).
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3,
                          "layer_types": ["sliding_attention", "full_attention"] * 2}, (8, None, 8, None)),
    ("Qwen3MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
     (8, 8, 8, 8)),
    # gpt-oss: no use_sliding_window; without layer_types the even layers slide.
    ("GptOssForCausalLM", {"sliding_window": 128}, (128, None, 128, None)),
    ("GptOssForCausalLM", {"sliding_window": 16, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     (None, None, None, 16)),
]


@pytest.mark.parametrize(("arch", "fields", "want"), CASES)
def test_windows_match_transformers(arch, fields, want):
    cfg = {"num_hidden_layers": 4, **fields}
    assert sliding_windows(arch, cfg) == want
    hf = CONFIGS[arch](**cfg)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM"):  # the classes that read layer types
        types = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
        assert (types if any(types) else ()) == want
    else:  # one window for every layer, or none
        assert want == ((hf.sliding_window,) * 4 if hf.sliding_window else ())


def test_kv_window_only_when_every_layer_slides():
    assert kv_sliding_window((32, 32)) == 32
    assert kv_sliding_window((None, 32)) is None
    assert kv_sliding_window(()) is None


@pytest.mark.parametrize("fields", [{"sliding_window": 0}, {"sliding_window": "4096"},
                                    {"sliding_window": True}])
def test_bad_windows_are_refused(fields):
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        sliding_windows("MistralForCausalLM", {"num_hidden_layers": 2, **fields})


def test_bad_layer_types_are_refused():
    cfg = {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 8,
           "layer_types": ["sliding_attention", "chunked_attention"]}
    with pytest.raises(ValueError, match="layer_types must name 2 layers, each one of full_attention, "
                                         "sliding_attention"):
        sliding_windows("Qwen2ForCausalLM", cfg)
