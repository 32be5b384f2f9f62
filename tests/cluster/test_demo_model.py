"""The random-weight demo checkpoints load in transformers and are deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagefleet.cluster.demo.model import default_demo_model_dir, write_demo_checkpoint
from pagefleet.worker.simulated import tokenizer as demo_tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
TEXT = "héllo wörld 你好 🙂"


def safetensors_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def test_tiny_llama_files_and_config(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    assert sorted(p.name for p in path.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((path / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 2048,
        "dtype": "float32", "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, [2, 4], 0)


def test_two_shards_and_index(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_shards=2)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == shard)
    # Sharding changes the files, not the weights.
    single = safetensors_tensors(tiny_checkpoint("llama"))
    sharded = safetensors_tensors(path)
    assert sorted(sharded) == sorted(single)
    assert all(torch.equal(sharded[name], single[name]) for name in single)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip_and_vocab(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 1000
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    ids = tokenizer(TEXT, add_special_tokens=True)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    # Whatever class transformers picks for the architecture (Qwen2Tokenizer
    # for qwen2), it encodes exactly as the saved tokenizer.json does.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in (TEXT, "The answer is 42.\n\n  def f(x): return x", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tokenizer(text)["input_ids"] == raw.encode(text).ids


def test_every_id_decodes(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    texts = [tokenizer.decode([token_id]) for token_id in range(1000)]
    assert texts[2] == "<|endoftext|>"
    assert all(isinstance(text, str) for text in texts)


def test_small_tokenizer_has_exactly_32000_entries():
    tokenizer = demo_tokenizer.build_demo_tokenizer(32000, 4096)
    assert len(tokenizer) == 32000
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(31990, 32000))
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT


def test_chat_template(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without_prompt.endswith("Hi there<|im_end|>\n")


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    first = write_demo_checkpoint(tmp_path / "a", seed=3)
    second = write_demo_checkpoint(tmp_path / "b", seed=3)
    other = write_demo_checkpoint(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    weights, other_weights = safetensors_tensors(first), safetensors_tensors(other)
    assert not torch.equal(weights["model.embed_tokens.weight"], other_weights["model.embed_tokens.weight"])
    assert not torch.equal(weights["lm_head.weight"], other_weights["lm_head.weight"])


def test_tokenizer_training_is_deterministic():
    # Bypass the in-process cache: a fresh training run gives the same file.
    assert demo_tokenizer._trained_tokenizer_json.__wrapped__(1000) == demo_tokenizer._trained_tokenizer_json(1000)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_greedy_outputs_differ(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    outputs = []
    for prompt in ("The quick brown fox", "Hello, world! How are you", "def main():\n    return 0"):
        input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        generated = model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        outputs.append(generated[0, input_ids.shape[1]:].tolist())
    assert all(len(tokens) == 8 for tokens in outputs)
    assert len({tuple(tokens) for tokens in outputs}) > 1
    # Not collapsed to one repeated token.
    assert all(len(set(tokens)) > 1 for tokens in outputs)


def test_architecture_specific_weights(tiny_checkpoint):
    llama = safetensors_tensors(tiny_checkpoint("llama"))
    qwen2 = safetensors_tensors(tiny_checkpoint("qwen2"))
    qwen3 = safetensors_tensors(tiny_checkpoint("qwen3"))
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].shape == (128,)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].shape == (64,)
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert qwen3["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert llama["model.layers.1.self_attn.k_proj.weight"].shape == (64, 128)
    assert llama["model.layers.1.mlp.gate_proj.weight"].shape == (256, 128)
    assert llama["lm_head.weight"].shape == (1000, 128)


def test_overrides_dtype_tying_kv_heads_vocab(tiny_checkpoint):
    path = tiny_checkpoint("llama", dtype="bfloat16", tie_word_embeddings=True, num_key_value_heads=1,
                           vocab_size=600)
    config = json.loads((path / "config.json").read_text())
    assert (config["dtype"], config["tie_word_embeddings"], config["num_key_value_heads"],
            config["vocab_size"]) == ("bfloat16", True, 1, 600)
    tensors = safetensors_tensors(path)
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.embed_tokens.weight"].shape == (600, 128)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 128)
    assert len(AutoTokenizer.from_pretrained(path)) == 600
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("kwargs, message", [
    ({"arch": "gpt2"}, "arch must be one of"),
    ({"size": "huge"}, "size must be one of"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"num_shards": 0}, "num_shards must be >= 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads must divide"),
    ({"vocab_size": 100}, "vocab_size must be at least 261"),
])
def test_bad_arguments_raise(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_demo_checkpoint(tmp_path, **kwargs)


def test_default_demo_model_dir_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    path = default_demo_model_dir()
    assert path.parent == tmp_path
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_demo_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime
    # No staging directories left behind.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
