"""Llama 3.1 / 3.2 JSON tool calling: the whole reply is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``, several separated by ``;``. A reply that does not begin with
an object is all content, as is everything from the first object that is not a call (a model
answering in plain JSON), or from whatever follows the calls.
"""

from __future__ import annotations

from enum import Enum

from pagefleet.router.openai.tool_parsers.base import ToolCallStream, ToolParser, partial_tag_len
from pagefleet.router.openai.tool_parsers.json_scan import CallObject, CallStatus, skip_space

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
ARGUMENT_KEYS = ("parameters", "arguments")


class _State(Enum):
    START = "start"  # before the first object
    CALL = "call"
    AFTER_CALL = "after_call"  # ";" or the end
    NEXT_CALL = "next_call"  # after ";": the next object
    CONTENT = "content"  # everything from here on is content


class Llama3JsonToolCallStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _State.START
        self._pos = 0
        self._call: CallObject | None = None
        self._call_start = 0  # where the current object's text (or the reply, for the first) begins

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            state = self._state
            if state is _State.CONTENT:
                self._emit_content(text[self._pos:])
                self._pos = len(text)
                return
            if state is _State.CALL:
                status = self._call.advance(text, len(text))
                if status is CallStatus.MALFORMED:
                    self._content_from(self._call_start if not self._call.started else self._call.malformed_at)
                elif status is CallStatus.DONE:
                    self._pos = self._call.scan.end
                    self._state = _State.AFTER_CALL
                elif final and not self._call.started:
                    self._content_from(self._call_start)
                else:
                    return
                continue
            pos = skip_space(text, self._pos, len(text))
            if state is _State.START and text.startswith(PYTHON_TAG, pos):
                pos = skip_space(text, pos + len(PYTHON_TAG), len(text))
            maybe_tag = state is _State.START and partial_tag_len(text, PYTHON_TAG, pos) == len(text) - pos
            if pos == len(text) or maybe_tag:
                if not final:
                    return
                self._content_from(self._call_start if state is _State.START else len(text))
                continue
            ch = text[pos]
            if state is _State.AFTER_CALL and ch == SEPARATOR:
                self._pos = pos + 1
                self._state = _State.NEXT_CALL
            elif state is not _State.AFTER_CALL and ch == "{":
                if state is _State.NEXT_CALL:
                    self._call_start = pos
                self._call = CallObject(self, pos, ARGUMENT_KEYS)
                self._state = _State.CALL
            else:
                self._content_from(self._call_start if state is _State.START else pos)

    def _content_from(self, at: int) -> None:
        self._pos = at
        self._state = _State.CONTENT


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonToolCallStream
