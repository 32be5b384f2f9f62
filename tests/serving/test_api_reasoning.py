"""--reasoning-parser over the real FastAPI app: a scripted worker writes a reasoning model's
answer, piece by piece with the tags cut across pieces, and the reasoning comes back in
reasoning_content, apart from content, in one answer and streamed; tool calls are read from
the content only; a grammar (which would constrain the reasoning too) is refused."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.output.reasoning import PARSERS
from pagefleet.router.openai.preprocess import ModelInfo
from pagefleet.router.openai.service import OpenAIService
from pagefleet.router.openai.tool_choice import ToolCallOptions
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.request_check import RequestLimits

from serving_fakes import MODEL, FakeWorkerClient, make_tokenizer

QWEN3 = ["<th", "ink>\nThe user", " greets. </thi", "nk>\n\nHello", " there!"]
TOOL = ["<think>call it</think>", '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


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


def _client(tokenizer, pieces, parser="qwen3", tools=ToolCallOptions()):
    info = ModelInfo(served_model_name=MODEL, limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=64,
                                                                   max_num_seqs=8))
    service = OpenAIService(tokenizer=tokenizer, info=info, client=ScriptedWorker(tokenizer, pieces), tools=tools,
                            reasoning=PARSERS[parser])
    return TestClient(build_openai_app(service))


def _streamed(client, body) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_reasoning_and_content_apart_in_one_answer_and_streamed(tokenizer):
    with _client(tokenizer, QWEN3) as client:
        message = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("\nThe user greets. ", "\n\nHello there!")
        deltas = _streamed(client, BODY)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user greets. "
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello there!"
    # No tag text leaks into either, and reasoning comes before any content.
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content + 1:])


@pytest.mark.parametrize("parser,pieces,expected", [
    ("qwen3", ["Just an ", "answer."], (None, "Just an answer.")),
    ("qwen3", ["<think>ran out of to", "kens"], ("ran out of tokens", None)),
    ("deepseek_r1", ["the prompt opened it", "</think>", "answer"], ("the prompt opened it", "answer")),
])
def test_each_parser_splits_as_its_template_opens_the_block(tokenizer, parser, pieces, expected):
    with _client(tokenizer, pieces, parser) as client:
        message = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
        deltas = _streamed(client, BODY)
    assert (message["reasoning_content"], message["content"]) == expected
    streamed = ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas))
    assert streamed == tuple(part or "" for part in expected)


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    with _client(_with_tools_template(), TOOL, tools=ToolCallOptions("hermes", True)) as client:
        body = {**BODY, "tools": TOOLS, "tool_choice": "auto"}
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "call it"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Oslo"})]
    assert choice["finish_reason"] == "tool_calls"


def test_a_grammar_is_refused_with_a_reasoning_parser(tokenizer):
    with _client(tokenizer, QWEN3) as client:
        r = client.post("/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "response_format")


def _with_tools_template():
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if tools %}tools: {{ tools | length }}{% endif %}")
    return tok
