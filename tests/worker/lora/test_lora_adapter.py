"""Adapters that cannot be served are refused when they are added, with the reason, and the
engine serves on: a rank over max_lora_rank, a target the model lacks, a malformed checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.block_hash import extra_keys_digest
from pagefleet.worker.lora.adapter import LoRAAdapterError
from pagefleet.worker.lora.request import LoRAModulePath, LoRARequest, parse_lora_module

from lora_helpers import ADAPTERS, peft_greedy, write_adapter


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return write_adapter(base, tmp_path_factory.mktemp("good") / "sql", *ADAPTERS["sql"])


@pytest.fixture(scope="module")
def llm(base, good):
    return LLM(model=str(base), dtype="float32", kv_cache_bytes=16 << 20, enable_lora=True, max_lora_rank=8,
               lora_modules=[LoRAModulePath("sql", str(good))])


def _copy(good, tmp_path, name="bad"):
    return shutil.copytree(good, tmp_path / name)


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(path, edit):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _refused(llm, path, match, lora_int_id=9):
    with pytest.raises(LoRAAdapterError, match=match):
        llm.engine.add_lora(LoRARequest("bad", lora_int_id, str(path)))
    assert lora_int_id not in llm.engine.loras


def test_a_rank_over_max_lora_rank_is_refused(llm, base, tmp_path):
    path = write_adapter(base, tmp_path / "wide", 16, 16, False, ["q_proj"], 5)
    _refused(llm, path, r"rank 16 is over max_lora_rank 8")


def test_a_target_the_model_lacks_is_refused(llm, good, tmp_path):
    path = _copy(good, tmp_path)  # trained on a deeper model: layer 5 of a 2-layer one
    _edit_weights(path, lambda t: t.update({k.replace("layers.0.", "layers.5."): v.clone() for k, v in t.items()}))
    _refused(llm, path, r"targets q_proj of layer 5, which the model lacks")
    path = _copy(good, tmp_path, "head")  # the LM head: not a projection pagefleet adapts
    _edit_weights(path, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 128)}))
    _refused(llm, path, r"'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a decoder layer")


@pytest.mark.parametrize("case, match", [
    ("no_config", r"no adapter_config.json"),
    ("bad_json", r"adapter_config.json: not valid JSON"),
    ("dora", r"use_dora set in adapter_config.json"),
    ("no_weights", r"no adapter_model.safetensors"),
    ("truncated", r"cannot be read as safetensors"),
    ("unpaired", r"layer 0 q_proj has lora_A without its pair"),
    ("shape", r"layer 0 q_proj: lora_A \(4, 64\) and lora_B \(128, 4\); the model and r=4 need \(4, 128\)"),
])
def test_a_malformed_adapter_is_refused(llm, good, tmp_path, case, match):
    path = _copy(good, tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    if case == "no_config":
        (path / "adapter_config.json").unlink()
    elif case == "bad_json":
        (path / "adapter_config.json").write_text("{r: 4")
    elif case == "dora":
        _edit_config(path, use_dora=True)
    elif case == "no_weights":
        (path / "adapter_model.safetensors").unlink()
    elif case == "truncated":
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    elif case == "unpaired":
        _edit_weights(path, lambda t: t.pop(key.format("B")))
    elif case == "shape":
        _edit_weights(path, lambda t: t.update({key.format("A"): t[key.format("A")][:, :64].contiguous()}))
    _refused(llm, path, match)


def test_the_engine_serves_on_after_refusals(llm, base, good):
    """After every refusal above (module-scoped engine), the adapter served from the start still
    equals PEFT, and the prompt's blocks are keyed by its name."""
    lora = llm.engine.loras[1]
    assert (lora.lora_name, lora.lora_path) == ("sql", str(good))
    prompt = llm.tokenizer.encode("one two three four five six seven")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       lora_request=lora)
    assert out[0].outputs[0].token_ids == peft_greedy(str(base), str(good), tuple(prompt), 8)


def test_one_id_names_one_adapter(llm, good):
    with pytest.raises(ValueError, match=r"lora_int_id 1 is registered as 'sql'"):
        llm.engine.add_lora(LoRARequest("other", 1, str(good)))
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql' is registered with lora_int_id 1 already"):
        llm.engine.add_lora(LoRARequest("sql", 2, str(good)))


def test_a_lora_request_without_enable_lora_is_refused(base, good):
    llm = LLM(model=str(base), dtype="float32", kv_cache_bytes=16 << 20)
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql': LoRA is not enabled \(enable_lora\)"):
        llm.generate("hi", lora_request=LoRARequest("sql", 1, str(good)))
    assert not llm.engine.has_unfinished()


def test_lora_modules_parse_as_vllm_writes_them():
    assert parse_lora_module("sql=/a/sql") == LoRAModulePath("sql", "/a/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "llama"}') == LoRAModulePath(
        "sql", "/a/sql", "llama")
    assert parse_lora_module({"name": "sql", "path": "/a/sql"}) == LoRAModulePath("sql", "/a/sql")
    with pytest.raises(ValueError, match="a lora module is name=path or JSON"):
        parse_lora_module("sql")
    with pytest.raises(ValueError, match="keys name, path and optionally base_model_name"):
        parse_lora_module('{"name": "sql"}')


def test_no_cache_salt_poses_as_an_adapter():
    assert extra_keys_digest((), "sql") != extra_keys_digest(("sql",))
    assert extra_keys_digest((), "sql") != extra_keys_digest(())
    assert extra_keys_digest(("t",), "sql") != extra_keys_digest(("t",), "chat")


def test_an_expert_layer_takes_no_lora(tiny_checkpoint, good, tmp_path):
    """Qwen3-MoE's layer 0 has experts, not gate/up/down projections: an adapter targeting them
    there is refused (layer 1 is dense and would take it)."""
    llm = LLM(model=str(tiny_checkpoint("qwen3_moe")), dtype="float32", kv_cache_bytes=16 << 20, enable_lora=True,
              max_lora_rank=8)
    path = _copy(good, tmp_path)
    _edit_weights(path, lambda t: t.update({
        "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 128),
        "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(96, 4)}))
    _refused(llm, path, r"targets gate_proj of layer 0, which the model lacks")
    manager = llm.engine.executor.runner.lora_manager
    assert (1, "gate_proj") in manager.shapes and (0, "gate_proj") not in manager.shapes
