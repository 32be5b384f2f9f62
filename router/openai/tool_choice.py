"""What a chat request's ``tools`` and ``tool_choice`` ask of the engine and of its output.

- ``none``: the tools are rendered into the prompt (as vLLM does), the output is plain content.
- ``auto``: the model decides; its text is parsed by the server's ``--tool-call-parser``
  (needs ``--enable-auto-tool-choice``, as in ``vllm serve``).
- a named function: the output is that function's arguments, constrained by the grammar to its
  ``parameters`` schema;
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects, constrained by
  the grammar to the tools' schemas (one element when ``parallel_tool_calls`` is false).

The two forced modes parse the grammar's output with streams of the same shape as the parsers'
(``ToolCallStream``), so the response builder treats every mode alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from pagefleet.router.openai.errors import bad_request
from pagefleet.router.openai.protocol import ChatCompletionRequest
from pagefleet.router.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_call_id,
)
from pagefleet.worker.sampling_params import StructuredOutputsParams
from pagefleet.worker.structured.json_schema import unenforced_keyword

# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class ToolCallOptions:
    """The server's tool calling (``--tool-call-parser``, ``--enable-auto-tool-choice``)."""

    parser: str | None = None
    enable_auto_tool_choice: bool = False


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: Literal["none", "auto", "named", "required"]
    tools: list[dict]  # as the chat template renders them: OpenAI's {"type": "function", "function": {...}}
    structured_outputs: StructuredOutputsParams | None  # the grammar of a forced mode
    parser: ToolParser | None = None  # auto's
    named: str | None = None
    parallel: bool = True

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output's content and calls (not for mode none)."""
        if self.mode == "auto":
            return self.parser.extract(text)
        return extract(self.stream(), text)

    def stream(self) -> "ToolCallStream | None":
        """A fresh per-choice stream over the output's text; None when the output is plain content."""
        if self.mode == "auto":
            return self.parser.stream()
        if self.mode == "named":
            return NamedCallStream(self.named)
        if self.mode == "required":
            return RequiredCallsStream(self.parallel)
        return None


def check_tool_count(tools: list | None) -> None:
    """Before any work that grows with the tools."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_request(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", "tools")


def tool_plan(req: ChatCompletionRequest, parser: ToolParser | None, auto_enabled: bool) -> ToolPlan | None:
    """The request's plan, or None when it carries no tools. Raises a 400 naming the field."""
    check_tool_count(req.tools)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if not FUNCTION_NAME.fullmatch(name):
            raise bad_request("a function's name must be 1 to 64 letters, digits, '_' or '-'",
                              f"tools.[{i}].function.name")
    if len(set(names)) != len(names):
        raise bad_request("two tools have the same function name", "tools")
    parallel = req.parallel_tool_calls is not False
    if choice is None:  # OpenAI's default with tools is auto; a server without a parser renders them only
        choice = "auto" if auto_enabled else "none"
    if choice == "none":
        return ToolPlan("none", tools, None)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                              "--tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools, None, parser=parser, parallel=parallel)
    if choice == "required":
        for i, tool in enumerate(tools):
            _check_enforced(tool, i)
        return ToolPlan("required", tools, StructuredOutputsParams(json=json.dumps(_required_schema(tools, parallel))),
                        parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools",
                          "tool_choice")
    _check_enforced(tools[names.index(name)], names.index(name))
    params = tools[names.index(name)]["function"].get("parameters") or {"type": "object"}
    return ToolPlan("named", tools, StructuredOutputsParams(json=json.dumps(params)), named=name)


def _check_enforced(tool: dict, index: int) -> None:
    """A forced call's arguments are held to its parameters' schema: refuse what the grammar would drop."""
    unenforced = unenforced_keyword(tool["function"].get("parameters") or {"type": "object"})
    if unenforced is not None:
        keyword, path, why = unenforced
        raise bad_request(f'the parameters of the function {tool["function"]["name"]!r} use "{keyword}" at '
                          f"{path}: {why}", f"tools.[{index}].function.parameters")


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ToolCallStream:
    """The parsers' stream interface (``tool_parsers``), restated for the forced modes."""

    def feed(self, delta_text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        raise NotImplementedError

    @property
    def tool_calls(self) -> list[ToolCall]:
        raise NotImplementedError


def extract(stream: ToolCallStream, text: str) -> ExtractedToolCalls:
    """A whole output through a stream: content and calls as the stream would have sent them."""
    first, last = stream.feed(text), stream.finish()
    content = first.content + last.content
    return ExtractedToolCalls(content or None, stream.tool_calls)


class NamedCallStream(ToolCallStream):
    """The output is the named function's arguments, sent as they come."""

    def __init__(self, name: str) -> None:
        self._call = ToolCall(make_call_id(), name, "")
        self._started = False

    def feed(self, delta_text: str) -> StreamDelta:
        self._call = self._call._replace(arguments=self._call.arguments + delta_text)
        if not self._started:
            self._started = True
            return StreamDelta("", [ToolCallDelta(0, self._call.id, self._call.name, delta_text)])
        return StreamDelta("", [ToolCallDelta(0, None, None, delta_text)] if delta_text else [])

    def finish(self) -> StreamDelta:
        return self.feed("") if not self._started else StreamDelta("", [])

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [self._call] if self._started else []


class RequiredCallsStream(ToolCallStream):
    """The output is a JSON array of {"name", "parameters"}: each element is sent as one call once
    it is complete (an element cut off by max_tokens is never sent)."""

    _decoder = json.JSONDecoder()

    def __init__(self, parallel: bool) -> None:
        self._text = ""
        self._pos = 0  # where the next element (or the array's opening) starts
        self._calls: list[ToolCall] = []
        self._parallel = parallel

    def feed(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        new = []
        while True:
            start = self._pos
            while start < len(self._text) and self._text[start] in " \t\r\n[,":
                start += 1
            if start >= len(self._text) or self._text[start] != "{":
                break
            try:
                element, end = self._decoder.raw_decode(self._text, start)
            except json.JSONDecodeError:
                break  # not complete yet
            self._pos = end
            if not self._parallel and self._calls:
                continue
            call = ToolCall(make_call_id(), element["name"], json.dumps(element["parameters"], ensure_ascii=False))
            new.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
            self._calls.append(call)
        return StreamDelta("", new)

    def finish(self) -> StreamDelta:
        return StreamDelta("", [])

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)
