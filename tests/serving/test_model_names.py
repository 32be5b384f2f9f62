"""Which model names a server answers to: vLLM's rules, so a client that worked against
`vllm serve --model DIR` needs no change (the cluster test sends the path itself)."""

from __future__ import annotations

import os

import openai
import pytest
from fastapi.testclient import TestClient

from pagefleet.router.ingress import load_model_info
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.model_executor.model_config import load_model_config

from serving_fakes import MAX_MODEL_LEN


def test_a_local_checkpoint_is_named_by_its_directory_and_answers_to_its_path(tiny_checkpoint, monkeypatch):
    ckpt = tiny_checkpoint("llama")
    cfg = load_model_config(str(ckpt))
    assert cfg.served_model_names == (ckpt.name,)
    assert cfg.served_model_name == ckpt.name
    assert cfg.model_path_names == (str(ckpt),)  # given absolute: the path as given is the absolute one
    monkeypatch.chdir(ckpt.parent)
    relative = load_model_config(f"./{ckpt.name}/")
    assert relative.served_model_names == (ckpt.name,)
    assert relative.model_path_names == (f"./{ckpt.name}/", str(ckpt.resolve()))


def test_served_model_names_replace_the_default_names(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    cfg = load_model_config(str(ckpt), served_model_name=["llama-3-tiny", "tiny"])
    assert cfg.served_model_names == ("llama-3-tiny", "tiny")
    assert cfg.model_path_names == ()  # as vLLM: names given, only they are served
    assert load_model_config(str(ckpt), served_model_name="one").served_model_names == ("one",)


@pytest.mark.parametrize("bad", [[], [""], ["ok", "  "]])
def test_empty_served_model_names_are_refused(bad):
    with pytest.raises(ValueError, match="served_model_name must be one or more non-empty names"):
        EngineArgs(served_model_name=bad)


def _openai_client(ckpt, fake, **engine) -> openai.OpenAI:
    tokenizer, info = load_model_info(EngineArgs(model=str(ckpt), max_model_len=MAX_MODEL_LEN, **engine))
    fake.tokenizer, fake.vocab_size = tokenizer, info.limits.vocab_size
    app = build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=fake))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=TestClient(app))


@pytest.fixture
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_the_path_as_given_and_the_directory_name_are_served_and_only_the_name_listed(ckpt, fake):
    client = _openai_client(ckpt, fake)
    assert [m.id for m in client.models.list().data] == [ckpt.name]  # /v1/models shows no path
    for name in (str(ckpt), ckpt.name):
        r = client.completions.create(model=name, prompt="hello", max_tokens=3)
        assert (r.model, r.usage.completion_tokens, r.choices[0].finish_reason) == (ckpt.name, 3, "length")
        chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2, stream=True))
        assert {c.model for c in chunks} == {ckpt.name}
    assert len(fake.requests) == 4
    for wrong in (str(ckpt.parent), ckpt.name + "/", os.path.basename(str(ckpt.parent))):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=wrong, prompt="hello", max_tokens=1)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert len(fake.requests) == 4


def test_served_model_names_are_listed_in_order_and_the_first_is_reported(ckpt, fake):
    client = _openai_client(ckpt, fake, served_model_name=["llama-3-tiny", "tiny"])
    assert [m.id for m in client.models.list().data] == ["llama-3-tiny", "tiny"]
    assert {m.root for m in client.models.list().data} == {"llama-3-tiny"}
    for name in ("llama-3-tiny", "tiny"):
        assert client.completions.create(model=name, prompt="hello", max_tokens=1).model == "llama-3-tiny"
    for unserved in (str(ckpt), ckpt.name):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=unserved, prompt="hello", max_tokens=1)


def test_a_lora_adapter_is_picked_by_model_listed_with_its_parent_and_hashed_apart(ckpt, fake):
    """As vLLM: --lora-modules adapters are models of their own name in /v1/models (parent: the base
    model, or the base_model_name given); a request's model picks one; the response reports it; its
    prompt's block hashes are under the adapter, so no prefix is shared with the base model."""
    modules = [LoRAModulePath("sql", "/adapters/sql"), LoRAModulePath("chat", "/adapters/chat", "llama-tiny")]
    client = _openai_client(ckpt, fake, enable_lora=True, lora_modules=modules)
    listed = {m.id: (m.root, m.model_extra["parent"]) for m in client.models.list().data}
    assert listed == {ckpt.name: (ckpt.name, None), "sql": ("sql", ckpt.name), "chat": ("chat", "llama-tiny")}
    prompt = "the quick brown fox jumps over the lazy dog"  # a full block to hash (max_model_len 64)
    for model in (ckpt.name, "sql", "chat"):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert r.model == model
    base_job, sql_job, chat_job = fake.routed[-3:]
    assert (base_job.lora_name, sql_job.lora_name, chat_job.lora_name) == (None, "sql", "chat")
    assert base_job.token_ids == sql_job.token_ids and len(base_job.block_hashes) >= 16
    assert len({base_job.block_hashes, sql_job.block_hashes, chat_job.block_hashes}) == 3
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="law", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert "the LoRA adapters `sql`, `chat`" in err.value.body["message"]
    assert len(fake.requests) == 3
