"""Tool-call parsers: a model family's generated text -> OpenAI tool calls, whole or streamed."""

from __future__ import annotations

from pagefleet.router.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from pagefleet.router.openai.tool_parsers.hermes import HermesToolParser
from pagefleet.router.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagefleet.router.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "get_tool_parser"]
