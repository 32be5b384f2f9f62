"""What the engine reads from a mixture-of-experts config.json: experts, top-k, which layers have
experts, and the parameter counts the planner's memory and decode roofline take (total for
memory, active for the bytes one token reads), held to transformers' own models."""

from __future__ import annotations

import json
import shutil

import pytest

from pagefleet.worker.model_executor.model_config import load_model_config

from hf_reference import hf_model


@pytest.mark.parametrize("arch,experts,layers", [("mixtral", 4, (0, 1)), ("qwen3_moe", 4, (0,))])
def test_experts_and_their_layers_are_read(tiny_checkpoint, arch, experts, layers):
    cfg = load_model_config(str(tiny_checkpoint(arch=arch)))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (experts, 2, layers)
    model = hf_model(str(tiny_checkpoint(arch=arch)))
    assert cfg.num_parameters == sum(p.numel() for p in model.parameters())
    # Active: the 2 of 4 experts a token runs, the router, everything else.
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_parameters - cfg.active_parameters_per_token == 2 * per_expert * len(layers)


def test_gpt_oss_counts_its_biases_and_sinks(tiny_checkpoint):
    """gpt-oss adds q/k/v and o_proj biases, a sink per head, router and expert biases: all counted."""
    cfg = load_model_config(str(tiny_checkpoint(arch="gpt_oss")))
    assert cfg.num_parameters == sum(p.numel() for p in hf_model(str(tiny_checkpoint(arch="gpt_oss"))).parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size + 2 * cfg.moe_intermediate_size + cfg.hidden_size
    inactive = (cfg.num_experts - cfg.num_experts_per_tok) * per_expert * len(cfg.moe_layers)
    assert cfg.num_parameters - cfg.active_parameters_per_token == inactive


def test_dense_models_count_every_parameter_as_active(tiny_checkpoint):
    cfg = load_model_config(str(tiny_checkpoint(arch="qwen3")))
    assert (cfg.num_experts, cfg.moe_layers) == (0, ())
    assert cfg.active_parameters_per_token == cfg.num_parameters == sum(
        p.numel() for p in hf_model(str(tiny_checkpoint(arch="qwen3"))).parameters())


def _edited(tiny_checkpoint, tmp_path, **changes):
    src = tiny_checkpoint(arch="qwen3_moe")
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_sparse_step_and_dense_layers_pick_the_expert_layers(tiny_checkpoint, tmp_path):
    path = _edited(tiny_checkpoint, tmp_path, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert load_model_config(path).moe_layers == (1, 5)


def test_more_experts_a_token_than_experts_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="num_experts_per_tok 5 is not between 1 and the 4 experts"):
        load_model_config(_edited(tiny_checkpoint, tmp_path, num_experts_per_tok=5))
