"""Resumable scanners over JSON text that is still arriving.

They find where values and members begin and end without parsing the values, so a call's
arguments can be handed out as raw slices of the model's text while it is generated. Values are
only bracket-counted (string-aware): an arguments object that is not valid JSON still ends where
its brackets close, and reaches the client as the model wrote it, as OpenAI's own ``arguments``
may be invalid JSON.
"""

from __future__ import annotations

import json
import re
from enum import Enum

from pagefleet.router.openai.tool_parsers.base import ToolCallStream

WHITESPACE = " \t\r\n"
_STRING_RUN = re.compile(r'[^"\\]+')
_PLAIN_RUN = re.compile(r'[^"\\{}\[\]]+')
_SCALAR_RUN = re.compile(r'[^,}\]' + WHITESPACE + "]+")


def _is_scalar(raw: str) -> bool:
    try:
        json.loads(raw)
    except json.JSONDecodeError:
        return False
    return True


def skip_space(text: str, pos: int, limit: int) -> int:
    while pos < limit and text[pos] in WHITESPACE:
        pos += 1
    return pos


class ValueScan:
    """Where one JSON value ends. ``text[start]`` is its first character; ``pos`` is how far it
    has been scanned and ``end`` is set (one past its last character) once it is complete."""

    __slots__ = ("_depth", "_escape", "_in_string", "_scalar", "end", "pos", "start")

    def __init__(self, start: int, first_char: str) -> None:
        self.start = start
        self.pos = start
        self.end: int | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._scalar = first_char not in '{["'

    def scan(self, text: str, limit: int) -> bool:
        """Scan up to ``limit``; True once the value is complete."""
        if self._scalar:
            m = _SCALAR_RUN.match(text, self.pos, limit)
            if m:
                self.pos = m.end()
            if self.pos < limit:
                self.end = self.pos  # the delimiter belongs to what follows
            return self.end is not None
        pos = self.pos
        while self.end is None and pos < limit:
            if self._escape:
                self._escape = False
                pos += 1
                continue
            run = (_STRING_RUN if self._in_string else _PLAIN_RUN).match(text, pos, limit)
            if run:
                pos = run.end()
                continue
            ch = text[pos]
            pos += 1
            if self._in_string:
                if ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.end = pos
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.end = pos
        self.pos = pos
        return self.end is not None


class _State(Enum):
    OPEN = "open"  # before "{"
    FIRST_KEY = "first_key"  # after "{": a key or "}"
    KEY = "key"  # after ",": a key
    IN_KEY = "in_key"
    COLON = "colon"
    VALUE = "value"  # after ":"
    IN_VALUE = "in_value"
    AFTER_VALUE = "after_value"  # "," or "}"
    DONE = "done"
    ERROR = "error"


class ObjectScan:
    """One JSON object, member by member: each complete member's raw value span, and which member's
    value is being scanned now. Structure outside the values is checked; an unexpected character
    stops the scan with ``error_at`` set to it."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.state = _State.OPEN
        self.members: dict[str, tuple[int, int]] = {}  # key -> (start, end) of its raw value text
        self.key: str | None = None  # the member being read
        self.value: ValueScan | None = None  # its value, while state is IN_VALUE (or a key, in IN_KEY)
        self.end: int | None = None  # one past "}" once DONE
        self.error_at: int | None = None

    @property
    def done(self) -> bool:
        return self.state is _State.DONE

    @property
    def failed(self) -> bool:
        return self.state is _State.ERROR

    def in_value_of(self, keys: tuple[str, ...]) -> bool:
        return self.state is _State.IN_VALUE and self.key in keys

    def scan(self, text: str, limit: int) -> None:
        while self.pos < limit and self.state not in (_State.DONE, _State.ERROR):
            state = self.state
            if state in (_State.IN_KEY, _State.IN_VALUE):
                if not self.value.scan(text, limit):
                    self.pos = self.value.pos
                    return
                self.pos = self.value.end
                if state is _State.IN_KEY:
                    try:
                        self.key = json.loads(text[self.value.start:self.value.end])
                    except json.JSONDecodeError:
                        self._fail(self.value.start)
                        return
                    self.state = _State.COLON
                else:
                    if text[self.value.start] not in '{["' and not _is_scalar(text[self.value.start:self.value.end]):
                        self._fail(self.value.start)
                        return
                    self.members.setdefault(self.key, (self.value.start, self.value.end))
                    self.state = _State.AFTER_VALUE
                continue
            self.pos = skip_space(text, self.pos, limit)
            if self.pos == limit:
                return
            ch = text[self.pos]
            if state is _State.OPEN and ch == "{":
                self.state = _State.FIRST_KEY
            elif state in (_State.FIRST_KEY, _State.KEY) and ch == '"':
                self.value = ValueScan(self.pos, ch)
                self.state = _State.IN_KEY
                continue
            elif (state is _State.FIRST_KEY or state is _State.AFTER_VALUE) and ch == "}":
                self.state = _State.DONE
                self.end = self.pos + 1
            elif state is _State.COLON and ch == ":":
                self.state = _State.VALUE
            elif state is _State.VALUE:
                self.value = ValueScan(self.pos, ch)
                self.state = _State.IN_VALUE
                continue
            elif state is _State.AFTER_VALUE and ch == ",":
                self.state = _State.KEY
            else:
                self._fail(self.pos)
                return
            self.pos += 1

    def _fail(self, at: int) -> None:
        self.state = _State.ERROR
        self.error_at = at


class CallStatus(Enum):
    PENDING = "pending"  # more text needed
    ARGUMENTS_DONE = "arguments_done"  # the call is complete; its object is not closed yet
    DONE = "done"  # the call is complete and its object closed
    MALFORMED = "malformed"  # not a call (``CallObject.malformed_at`` says from where)


class CallObject:
    """One call written as a JSON object ``{"name": ..., <args key>: {...}}``, turned into stream
    events as it arrives.

    The call starts (its id and name go out) as soon as the name is known and the arguments
    object has begun; its arguments then go out as raw text. When the arguments come before the
    name, the call goes out whole once the object closes. Without an arguments member the
    arguments are ``{}``; arguments written as a JSON string holding an object are that string's
    text. An object that is not a call (no string name, other arguments, broken structure before
    the call started) is MALFORMED and its format's stream treats its text as content.
    """

    def __init__(self, stream: ToolCallStream, start: int, argument_keys: tuple[str, ...]) -> None:
        self.stream = stream
        self.scan = ObjectScan(start)
        self.argument_keys = argument_keys
        self.started = False  # the call has gone out
        self.arguments_done = False
        self.malformed_at: int | None = None
        self._arguments_from = 0  # next argument character to hand out
        self._arguments_key: str | None = None

    def advance(self, text: str, limit: int) -> CallStatus:
        scan = self.scan
        scan.scan(text, limit)
        if not self.started:
            name_span = scan.members.get("name")
            name = _nonempty_string(text[name_span[0]:name_span[1]]) if name_span else None
            if name_span and name is None:
                return self._malformed(name_span[0])
            arguments = self._arguments_begun()
            if name is not None and arguments is not None and text[arguments[1]] == "{":
                self.started = True
                self._arguments_key, self._arguments_from = arguments
                self.stream._start_call(name)
            elif scan.done:
                return self._whole(text, name)
            elif scan.failed:
                return self._malformed(scan.error_at)
            else:
                return CallStatus.PENDING
        if not self.arguments_done:
            span = scan.members.get(self._arguments_key)
            upto = span[1] if span is not None else scan.value.pos
            self.stream._emit_arguments(text[self._arguments_from:upto])
            self._arguments_from = upto
            if span is not None:
                self._finish_arguments()
        if scan.failed:
            return self._malformed(scan.error_at)
        if scan.done:
            return CallStatus.DONE
        return CallStatus.ARGUMENTS_DONE if self.arguments_done else CallStatus.PENDING

    def _arguments_begun(self) -> tuple[str, int] | None:
        """The arguments member's key and where its value starts, once it has begun."""
        scan = self.scan
        for key in self.argument_keys:
            if key in scan.members:
                return key, scan.members[key][0]
        if scan.in_value_of(self.argument_keys):
            return scan.key, scan.value.start
        return None

    def _whole(self, text: str, name: str | None) -> CallStatus:
        arguments = self._closed_arguments(text)
        if name is None or arguments is None:
            return self._malformed(self.scan.end)
        self.started = True
        self.stream._start_call(name)
        self.stream._emit_arguments(arguments)
        self._finish_arguments()
        return CallStatus.DONE

    def _closed_arguments(self, text: str) -> str | None:
        """A closed object's arguments: its arguments object's text, the object text a JSON string
        holds, or ``{}`` without an arguments member; None for anything else."""
        key = next((k for k in self.argument_keys if k in self.scan.members), None)
        if key is None:
            return "{}"
        start, end = self.scan.members[key]
        raw = text[start:end]
        if raw.startswith("{"):
            return raw
        return _object_in_string(raw) if raw.startswith('"') else None

    def _finish_arguments(self) -> None:
        self.arguments_done = True
        self.stream._complete_call()

    def _malformed(self, at: int) -> CallStatus:
        self.malformed_at = at
        return CallStatus.MALFORMED


def _nonempty_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) and value else None


def _object_in_string(raw: str) -> str | None:
    """The text of a JSON string value, when that text is a JSON object."""
    try:
        inner = json.loads(raw)
        return inner if isinstance(json.loads(inner), dict) else None
    except (json.JSONDecodeError, TypeError):
        return None
