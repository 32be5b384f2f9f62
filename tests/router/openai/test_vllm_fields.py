"""Every field of vLLM's OpenAI request models (vLLM 0.32.0's, tests/data/vllm_request_fields.json)
is either a field of pagefleet's request models, implemented, or one of vllm_fields.NOT_IMPLEMENTED,
refused with a 400 naming it when set to anything but vLLM's default; never a 200 that ignores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.openai.preprocess import check_not_implemented
from pagefleet.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagefleet.router.openai.vllm_fields import NOT_IMPLEMENTED

VLLM = json.loads((Path(__file__).resolve().parents[2] / "data" / "vllm_request_fields.json").read_text())
MODELS = {"completions": CompletionRequest, "chat_completions": ChatCompletionRequest}
BASE = {"completions": {"prompt": "hi"}, "chat_completions": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("api", MODELS)
def test_every_vllm_field_is_implemented_or_refused(api):
    assert VLLM["vllm_version"] == "0.32.0"
    ours = set(MODELS[api].model_fields)
    neither = sorted(set(VLLM[api]) - ours - set(NOT_IMPLEMENTED[api]))
    assert neither == []
    # A refusal names vLLM's own default: a client that sends it gets what vLLM would give.
    for name, default in NOT_IMPLEMENTED[api].items():
        if name in VLLM[api]:
            assert VLLM[api][name] == default, name
    # Nothing is listed as refused that pagefleet's model declares (it would be silently taken).
    assert not ours & set(NOT_IMPLEMENTED[api])


def _other_than(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    return {"something": 1} if default is None else default + "-other"


@pytest.mark.parametrize("api,name", [(api, name) for api in MODELS for name in NOT_IMPLEMENTED[api]])
def test_an_unimplemented_field_set_is_refused_by_name_and_its_default_passes(api, name):
    default = NOT_IMPLEMENTED[api][name]
    req = MODELS[api].model_validate({**BASE[api], name: default})
    check_not_implemented(req)  # vLLM's default, sent explicitly: nothing asked for
    req = MODELS[api].model_validate({**BASE[api], name: _other_than(default)})
    with pytest.raises(OpenAIError) as err:
        check_not_implemented(req)
    assert (err.value.status_code, err.value.param, err.value.code) == (400, name, "unsupported")


def test_fields_no_vllm_model_has_are_still_ignored():
    check_not_implemented(CompletionRequest.model_validate({"prompt": "hi", "metadata": {"a": 1}, "store": True}))
