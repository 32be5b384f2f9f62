"""POST /v1/responses through the real app with the openai client's ``client.responses.create``:
the tiny Llama checkpoint's greedy answer equals its chat completion's, whole and streamed (the
events in OpenAI's order, numbered), usage counted exactly, ``max_output_tokens`` making the
response incomplete, what this server does not honour refused naming the field, and a scripted
tool call coming back as a ``function_call`` item."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from pagefleet.router.ingress import load_model_info
from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.output.reasoning import PARSERS
from pagefleet.router.openai.preprocess import ModelInfo
from pagefleet.router.openai.service import OpenAIService
from pagefleet.router.openai.tool_choice import ToolCallOptions
from pagefleet.worker import AsyncLLMEngine, EngineArgs
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.request_check import RequestLimits

from serving_fakes import MODEL, FakeWorkerClient, make_tokenizer

MAX_MODEL_LEN = 128
NAME = "llama"  # the tiny checkpoint's directory, the name it is served under
INSTRUCTIONS = "Answer briefly."
QUESTION = "What is the capital of France?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


class EngineWorker:
    """The worker client over an in-process engine: what a replica would run, without Ray."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.requests: list = []
        self.block_size = 0

    def check_room(self) -> None:
        pass

    async def route(self, job) -> None:
        return None

    def generate(self, job):
        self.requests.append((job.request_id, list(job.token_ids), job.params))
        return self.engine.generate(job.request_id, job.token_ids, job.params)

    async def check_health(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """(openai client, worker) over the app serving the tiny Llama checkpoint."""
    args = EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_bytes=16 << 20,
                      max_model_len=MAX_MODEL_LEN)
    engine = AsyncLLMEngine(args)
    tokenizer, info = load_model_info(args)
    worker = EngineWorker(engine)
    worker.block_size = info.block_size
    app = build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=worker))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http), worker
    engine.shutdown()


def _chat(client, max_tokens: int):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(model=NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0)


def test_the_answer_is_the_chat_completions_answer_with_exact_usage(tiny):
    client, worker = tiny
    chat = _chat(client, 12)
    worker.requests.clear()
    r = client.responses.create(model=chat.model, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == chat.model
    assert [item.type for item in r.output] == ["message"]
    assert [part.type for part in r.output[0].content] == ["output_text"]
    assert r.output_text == chat.choices[0].message.content and r.output_text
    # The same prompt tokens and sampling as the chat request.
    (_, prompt_ids, params), = worker.requests
    assert (params.max_tokens, params.temperature) == (12, 0.0)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (
        len(prompt_ids), 12, len(prompt_ids) + 12)
    # The chat request left the prompt's full blocks in the prefix cache, all but the one holding
    # its last token (which the engine always computes).
    block_size = worker.block_size
    assert r.usage.input_tokens_details.cached_tokens == (len(prompt_ids) - 1) // block_size * block_size > 0
    assert (r.instructions, r.max_output_tokens, r.temperature) == (INSTRUCTIONS, 12, 0.0)


def test_a_list_of_message_items_is_the_same_conversation(tiny):
    client, worker = tiny
    messages = [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    worker.requests.clear()
    r = client.responses.create(model=NAME, max_output_tokens=6, temperature=0, input=[
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    (_, prompt_ids, _), = worker.requests
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 6) == (len(prompt_ids), 6)


def test_max_output_tokens_makes_the_response_incomplete(tiny):
    client, _ = tiny
    r = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=3, temperature=0)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[0].status == "incomplete"


def test_streamed_deltas_join_to_the_same_text_in_openais_event_order(tiny):
    client, _ = tiny
    whole = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=10,
                                    temperature=0)
    events = list(client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=10, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == STREAM_EVENTS + ["response.output_text.delta"] * len(deltas) + STREAM_END + ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and events[-2].item.id == item_id
    assert events[-2].item.content[0].text == whole.output_text
    created, final = events[0].response, events[-1].response
    assert (created.status, created.output, final.status, final.id) == ("in_progress", [], "incomplete", created.id)
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 10)


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_0"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"metadata": {"k": "v"}}, "metadata"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
])
def test_what_this_server_does_not_honour_is_refused_naming_it(tiny, fields, param):
    client, worker = tiny
    worker.requests.clear()
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=NAME, input=QUESTION, max_output_tokens=2, **fields)
    assert (err.value.status_code, err.value.body["param"], err.value.body["code"]) == (400, param, "unsupported")
    assert worker.requests == []


def test_defaults_and_nulls_of_unhonoured_fields_are_accepted(tiny):
    client, _ = tiny
    r = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=2, store=False, background=False,
                                truncation="disabled", previous_response_id=None)
    assert r.usage.output_tokens == 2


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user"}]}, "input.[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.[0].arguments"),
    ({"input": [{"role": "user", "content": "hi", "output": "x"}]}, "input.[0].output"),
    ({"input": "hi", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
])
def test_bad_input_names_the_responses_field(tiny, body, param):
    client, _ = tiny
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", cast_to=object, body={"model": "llama", **body})
    assert err.value.body["param"] == param


# ---- function tools (a scripted worker writes a hermes tool call) ----------------------------------

CALL = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']


class ScriptedWorker(FakeWorkerClient):
    """Answers every request with ``pieces``, one per step (token ids are placeholders)."""

    def __init__(self, tokenizer, pieces: list[str]) -> None:
        super().__init__(tokenizer, vocab_size=len(tokenizer))
        self.pieces = pieces

    async def generate(self, job):
        self.requests.append((job.request_id, list(job.token_ids), job.params))
        for step, piece in enumerate(self.pieces):
            last = step == len(self.pieces) - 1
            yield RequestOutputDelta(job.request_id, [CompletionOutput(0, piece, [5], None, "stop" if last else None)],
                                     len(job.token_ids), 0, last)


@pytest.fixture
def scripted():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if tools %}"
                               "tools: {{ tools | map(attribute='function.name') | join(',') }}{% endif %}")
    info = ModelInfo(served_model_name=MODEL, limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=64,
                                                                   max_num_seqs=8))
    worker = ScriptedWorker(tokenizer, CALL)
    service = OpenAIService(tokenizer=tokenizer, info=info, client=worker, tools=ToolCallOptions("hermes", True))
    with TestClient(build_openai_app(service)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                            http_client=http), worker, tokenizer


def test_a_tool_call_comes_back_as_a_function_call_item(scripted):
    client, worker, tokenizer = scripted
    r = client.responses.create(model=MODEL, input="weather in Oslo?", tools=TOOLS, tool_choice="auto")
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Oslo"}, "completed")
    assert call.call_id.startswith("call") and r.status == "completed"
    assert tokenizer.decode(worker.requests[0][1]).endswith("tools: get_weather")  # the template got the tools
    assert [t.name for t in r.tools] == ["get_weather"] and r.tool_choice == "auto"


def test_a_streamed_tool_call_is_one_function_call_item_with_its_arguments(scripted):
    client, _, _ = scripted
    events = list(client.responses.create(model=MODEL, input="weather in Oslo?", tools=TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert (added.type, added.name, added.status, done.status) == ("function_call", "get_weather", "in_progress",
                                                                   "completed")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Oslo"} and done.arguments == arguments == events[-3].arguments
    assert [item.type for item in events[-1].response.output] == ["function_call"]
    assert events[-1].response.output[0].call_id == added.call_id


def test_a_call_and_its_output_sent_back_become_the_assistant_call_and_the_tool_message(scripted):
    client, worker, tokenizer = scripted
    client.responses.create(model=MODEL, tools=TOOLS, tool_choice="none", input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    prompt = tokenizer.decode(worker.requests[-1][1])
    assert prompt.startswith("user: weather?\nassistant: \ntool: sunny\n"), prompt


QWEN3 = ["<th", "ink>\nThe user", " greets. </thi", "nk>\n\nHello", " there!"]


def test_a_reasoning_models_answer_is_a_reasoning_item_then_the_message(tokenizer):
    info = ModelInfo(served_model_name=MODEL, limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=64,
                                                                   max_num_seqs=8))
    service = OpenAIService(tokenizer=tokenizer, info=info, client=ScriptedWorker(tokenizer, QWEN3),
                            reasoning=PARSERS["qwen3"])
    with TestClient(build_openai_app(service)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)
        r = client.responses.create(model=MODEL, input="hi")
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    reasoning, message = r.output
    assert (reasoning.type, reasoning.content[0].text, message.type, r.output_text) == (
        "reasoning", "\nThe user greets. ", "message", "\n\nHello there!")
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert set(types[3:types.index("response.reasoning_text.done")]) == {"response.reasoning_text.delta"}
    assert types[types.index("response.reasoning_text.done"):first_text] == [
        "response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
        "response.content_part.added"]
    assert types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nThe user greets. "
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nHello there!"
    assert [(i.type, i.status) for i in events[-1].response.output] == [("reasoning", "completed"),
                                                                      ("message", "completed")]


def test_a_failure_after_the_200_is_an_error_event_and_the_response_does_not_complete(service, fake):
    fake.fail_after_steps = 2
    with TestClient(build_openai_app(service)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)
        events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=5, stream=True))
    types = [e.type for e in events]
    assert types == STREAM_EVENTS + ["response.output_text.delta"] * 2 + ["error"]
    assert events[-1].code == "internal_error" and events[-1].sequence_number == len(events) - 1
    assert len(fake.requests) == 1
