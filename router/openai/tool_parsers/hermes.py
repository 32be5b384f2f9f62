"""Hermes-style calls, as Qwen2.5, Qwen3 and NousResearch Hermes models write them:

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

Each block holds one JSON object. The first ``</tool_call>`` closes a block, as in the models'
training format (the tags are single tokens there). A block whose object is not a call is content,
tags included. A block cut off (no end tag before the text ends) keeps what it has.
"""

from __future__ import annotations

from enum import Enum

from pagefleet.router.openai.tool_parsers.base import ToolCallStream, ToolParser, partial_tag_len
from pagefleet.router.openai.tool_parsers.json_scan import CallObject, CallStatus

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


class _State(Enum):
    TEXT = "text"
    CALL = "call"  # inside a block, its object being read
    TRAILER = "trailer"  # the call is complete: skip to the end tag


class HermesToolCallStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _State.TEXT
        self._pos = 0
        self._block_start = 0  # where the current block's start tag is
        self._end_from = 0  # no end tag begins before this
        self._call: CallObject | None = None

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            if self._state is _State.TEXT:
                at = text.find(START_TAG, self._pos)
                if at == -1:
                    keep = 0 if final else partial_tag_len(text, START_TAG, self._pos)
                    self._emit_content(text[self._pos:len(text) - keep])
                    self._pos = len(text) - keep
                    return
                self._emit_content(text[self._pos:at])
                self._block_start = at
                self._pos = self._end_from = at + len(START_TAG)
                self._call = CallObject(self, self._pos, ARGUMENT_KEYS)
                self._state = _State.CALL
                continue
            end_at = self._find_end_tag(text)
            if self._state is _State.TRAILER:
                if end_at == -1:
                    return
                self._leave_block(end_at)
                continue
            if end_at != -1:
                limit = end_at
            else:
                limit = len(text) if final else len(text) - partial_tag_len(text, END_TAG, self._pos)
            status = self._call.advance(text, limit)
            if status is CallStatus.MALFORMED and not self._call.started:
                self._not_a_call(self._call.malformed_at)
            elif status is not CallStatus.PENDING:  # what follows a call's arguments is skipped
                self._state = _State.TRAILER
            elif end_at != -1:
                if self._call.started:  # cut off by the end tag: the call keeps what it has
                    self._leave_block(end_at)
                else:
                    self._not_a_call(end_at)
            elif final:
                if not self._call.started:
                    self._not_a_call(len(text))
                return
            else:
                return

    def _find_end_tag(self, text: str) -> int:
        at = text.find(END_TAG, self._end_from)
        if at == -1:
            self._end_from = max(self._end_from, len(text) - len(END_TAG) + 1)
        return at

    def _leave_block(self, end_at: int) -> None:
        self._pos = end_at + len(END_TAG)
        self._state = _State.TEXT

    def _not_a_call(self, upto: int) -> None:
        """The block's text up to ``upto`` is content; the rest is read as text again."""
        self._emit_content(self._text[self._block_start:upto])
        self._pos = upto
        self._state = _State.TEXT


class HermesToolParser(ToolParser):
    name = "hermes"
    stream_class = HermesToolCallStream
