"""Mistral's tool calls, in both of the forms its tokenizers write (mistral-common's
``InstructTokenizerV2``..``V7`` and ``V11``+):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, ...]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The second may carry ``[CALL_ID]id`` between the name and ``[ARGS]`` (V11). Ids the model writes
are not kept: every call gets the parser's own. Text before ``[TOOL_CALLS]``, and after the calls,
is content; a ``[TOOL_CALLS]`` not followed by a call is content too.

``[TOOL_CALLS]`` is a special token: the text given to the parser must be decoded with special
tokens kept.
"""

from __future__ import annotations

import re
from enum import Enum

from pagefleet.router.openai.tool_parsers.base import ToolCallStream, ToolParser, partial_tag_len
from pagefleet.router.openai.tool_parsers.json_scan import CallObject, CallStatus, ValueScan, skip_space

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ARGUMENT_KEYS = ("arguments",)
_NAME_RUN = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_RUN = re.compile(r"[A-Za-z0-9]+")


class _State(Enum):
    TEXT = "text"
    AFTER_TAG = "after_tag"  # "[" (a JSON array) or a name
    ARRAY_ITEM = "array_item"  # "{" of the next call, or "]"
    ARRAY_CALL = "array_call"
    ARRAY_SEP = "array_sep"  # "," or "]"
    NAME = "name"  # up to [CALL_ID] or [ARGS]
    CALL_ID = "call_id"  # up to [ARGS]
    ARGS = "args"  # before the arguments object
    ARGS_OBJECT = "args_object"


class MistralToolCallStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = _State.TEXT
        self._pos = 0
        self._tag_start = 0  # text from here is content if what follows the tag is not a call
        self._name_start = 0
        self._name = ""
        self._call: CallObject | None = None
        self._arguments: ValueScan | None = None

    def _advance(self, final: bool) -> None:
        text = self._text
        end = len(text)
        while True:
            state = self._state
            if state is _State.TEXT:
                at = text.find(TOOL_CALLS, self._pos)
                if at == -1:
                    keep = 0 if final else partial_tag_len(text, TOOL_CALLS, self._pos)
                    self._emit_content(text[self._pos:end - keep])
                    self._pos = end - keep
                    return
                self._emit_content(text[self._pos:at])
                self._tag_start = at
                self._pos = at + len(TOOL_CALLS)
                self._state = _State.AFTER_TAG
                continue
            if state is _State.ARRAY_CALL:
                status = self._call.advance(text, end)
                if status is CallStatus.MALFORMED:
                    at = self._call.malformed_at
                    self._not_a_call(at if self._call.started else self._tag_start, at)
                elif status is CallStatus.DONE:
                    self._pos = self._call.scan.end
                    self._tag_start = self._pos  # the calls so far stand whatever follows
                    self._state = _State.ARRAY_SEP
                elif final and not self._call.started:
                    self._not_a_call(self._tag_start, end)
                else:
                    return
                continue
            if state is _State.ARGS_OBJECT:
                complete = self._arguments.scan(text, end)
                self._emit_arguments(text[self._pos:self._arguments.pos])
                self._pos = self._arguments.pos
                if not complete:
                    return
                self._complete_call()
                self._state = _State.TEXT
                continue
            if state in (_State.NAME, _State.CALL_ID):
                run = (_NAME_RUN if state is _State.NAME else _ID_RUN).match(text, self._pos)
                pos = run.end() if run else self._pos
                if state is _State.NAME:
                    self._name = text[self._name_start:pos]
                if pos == end or (not final and _is_tag_start(text, pos)):
                    self._pos = pos
                    if final:
                        self._not_a_call(self._tag_start, end)
                        continue
                    return
                if text.startswith(ARGS, pos) and self._name:
                    self._pos = pos + len(ARGS)
                    self._state = _State.ARGS
                elif state is _State.NAME and text.startswith(CALL_ID, pos) and self._name:
                    self._pos = pos + len(CALL_ID)
                    self._state = _State.CALL_ID
                else:
                    self._not_a_call(self._tag_start, pos)
                continue
            pos = skip_space(text, self._pos, end)
            if pos == end:
                if final:
                    self._not_a_call(self._tag_start, end)
                    continue
                return
            ch = text[pos]
            if state is _State.AFTER_TAG:
                if ch == "[":
                    self._pos = pos + 1
                    self._state = _State.ARRAY_ITEM
                else:
                    self._pos = self._name_start = pos
                    self._state = _State.NAME
            elif state is _State.ARRAY_ITEM and ch == "{":
                self._call = CallObject(self, pos, ARGUMENT_KEYS)
                self._state = _State.ARRAY_CALL
            elif state is _State.ARRAY_ITEM and ch == "]":  # an empty list of calls
                self._pos = pos + 1
                self._state = _State.TEXT
            elif state is _State.ARRAY_SEP and ch in ",]":
                self._pos = pos + 1
                self._state = _State.ARRAY_ITEM if ch == "," else _State.TEXT
            elif state is _State.ARGS and ch == "{":
                self._start_call(self._name)
                self._arguments = ValueScan(pos, ch)
                self._pos = pos
                self._state = _State.ARGS_OBJECT
            else:
                self._not_a_call(pos if state is _State.ARRAY_SEP else self._tag_start, pos)

    def _not_a_call(self, start: int, stop: int) -> None:
        """``text[start:stop]`` is content after all, and the text from ``stop`` on is read as
        text again (``stop`` is past the tag, so the same tag is not read twice)."""
        self._emit_content(self._text[start:stop])
        self._pos = stop
        self._state = _State.TEXT


def _is_tag_start(text: str, pos: int) -> bool:
    """``text[pos:]`` is all of, or the beginning of, [ARGS] or [CALL_ID]."""
    rest = text[pos:pos + len(CALL_ID)]
    return any(len(rest) < len(tag) and tag.startswith(rest) for tag in (ARGS, CALL_ID))


class MistralToolParser(ToolParser):
    name = "mistral"
    stream_class = MistralToolCallStream
    reads_special_tokens = True  # [TOOL_CALLS] is a control token of Mistral's tokenizers
