"""tool_choice: what each mode asks of the engine (the grammar of the forced modes), how the forced
modes' output becomes tool calls (whole and streamed in any pieces), and the chat response
builder's tool_calls, whole and as OpenAI stream deltas."""

from __future__ import annotations

import json
import re

import pytest

from pagefleet.router.openai.output.responses import ChatResponseBuilder
from pagefleet.router.openai.protocol import ChatCompletionRequest
from pagefleet.router.openai.tool_choice import tool_plan
from pagefleet.router.openai.tool_parsers import get_tool_parser
from pagefleet.worker.outputs import CompletionOutput

from test_tool_parsers import CALL_ID, pieces_of, stream_pieces

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]


def _req(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_named_function_is_its_parameters_schema_and_its_output_is_the_arguments():
    plan = tool_plan(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                     None, False)
    assert plan.mode == "named" and json.loads(plan.structured_outputs.json) == WEATHER
    assert plan.tools == TOOLS
    args = '{"city": "Paris", "days": 3}'
    for pieces in pieces_of(args):
        content, calls = stream_pieces(plan, pieces)
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", args)]
    whole = plan.extract(args)
    assert whole.content is None and [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", args)]
    assert CALL_ID.fullmatch(whole.tool_calls[0].id)
    # a function without parameters takes any object
    plan = tool_plan(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), None, False)
    assert json.loads(plan.structured_outputs.json) == {"type": "object"}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_the_tools_calls_sent_as_each_one_completes(parallel):
    plan = tool_plan(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel), None, False)
    schema = json.loads(plan.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == (None if parallel else 1)
    assert [branch["properties"]["name"] for branch in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["now"]}]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    text = '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "now", "parameters": {}}]'
    want = [("get_weather", '{"city": "Zürich"}'), ("now", "{}")] if parallel else [("get_weather", '{"city": "Zürich"}')]
    for pieces in pieces_of(text):
        content, calls = stream_pieces(plan, pieces)
        assert content == "" and [(c.name, c.arguments) for c in calls] == want
    assert [(c.name, c.arguments) for c in plan.extract(text).tool_calls] == want


def test_a_required_call_cut_off_by_max_tokens_is_not_sent():
    plan = tool_plan(_req(tools=TOOLS, tool_choice="required"), None, False)
    cut = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    assert [c.name for c in plan.extract(cut).tool_calls] == ["now"]


def test_modes_and_defaults():
    hermes = get_tool_parser("hermes")
    assert tool_plan(_req(), hermes, True) is None
    assert tool_plan(_req(tools=TOOLS), hermes, True).mode == "auto"  # OpenAI's default with tools
    assert tool_plan(_req(tools=TOOLS), None, False).mode == "none"  # no parser here: rendered only
    none = tool_plan(_req(tools=TOOLS, tool_choice="none"), hermes, True)
    assert none.mode == "none" and none.structured_outputs is None and none.tools == TOOLS
    auto = tool_plan(_req(tools=TOOLS, tool_choice="auto"), hermes, True)
    assert auto.structured_outputs is None and auto.parser is hermes


def _builder(plan) -> ChatResponseBuilder:
    return ChatResponseBuilder(request_id="chatcmpl-1", model="m", tokenizer=None, want_logprobs=False,
                               tool_plan=plan)


def test_the_builder_answers_tool_calls_with_finish_reason_tool_calls():
    plan = tool_plan(_req(tools=TOOLS, tool_choice="auto"), get_tool_parser("hermes"), True)
    builder = _builder(plan)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    builder.accumulate(0, CompletionOutput(0, text, [1, 2, 3], None, "stop"))
    (choice,) = builder.full_response()["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert call["type"] == "function" and CALL_ID.fullmatch(call["id"])
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # cut off by max_tokens: the reason stays "length"
    builder = _builder(plan)
    builder.accumulate(0, CompletionOutput(0, text, [1, 2, 3], None, "length"))
    assert builder.full_response()["choices"][0]["finish_reason"] == "length"


def test_streamed_tool_calls_are_openai_deltas():
    plan = tool_plan(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                     None, False)
    builder = _builder(plan)
    chunks = [builder.delta_chunk(0, CompletionOutput(0, piece, [7], None, finish))
              for piece, finish in (('{"city": ', None), ('"Rome"}', "stop"))]
    first, last = (c["choices"][0] for c in chunks)
    (opening,) = first["delta"]["tool_calls"]
    assert re.fullmatch(r"call_\w{24}", opening.pop("id"))
    assert opening == {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}
    assert first["delta"].keys() == {"tool_calls"} and first["finish_reason"] is None
    assert last["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}
    assert last["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser, keeps", [("hermes", False), ("llama3_json", False), ("mistral", True)])
def test_auto_keeps_special_tokens_in_the_text_for_a_parser_that_reads_them(parser, keeps):
    from pagefleet.router.openai.preprocess import chat_sampling_params

    req = _req(tools=TOOLS, tool_choice="auto")
    params = chat_sampling_params(req, tool_plan(req, get_tool_parser(parser), True))
    assert params.skip_special_tokens is not keeps and params.structured_outputs is None
