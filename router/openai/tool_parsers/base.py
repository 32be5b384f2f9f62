"""What every tool-call parser shares: the result types, the streaming bookkeeping, and ``extract``
as one pass of the stream, so a whole text and the same text in pieces give the same answer.

A format's stream (``hermes``, ``llama3_json``, ``mistral``) only says what its text is: content,
the start of a call, more of a call's arguments, the end of a call. This base turns that into
OpenAI's streaming deltas and keeps the calls.

Whitespace next to a call (the newline between two ``<tool_call>`` blocks, the one before the
first) is dropped from content, so a reply made only of calls has no content. Whitespace between
content and content is kept.
"""

from __future__ import annotations

import secrets
import string
from typing import ClassVar, NamedTuple

_ID_ALPHABET = string.ascii_letters + string.digits


class ToolCall(NamedTuple):
    """One complete call."""

    id: str  # "call_" + 24 random alphanumerics, made by the parser
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it


class ExtractedToolCalls(NamedTuple):
    content: str | None  # text outside the calls; None when empty
    tool_calls: list[ToolCall]


class ToolCallDelta(NamedTuple):
    """One entry of an OpenAI streaming chunk's ``tool_calls``."""

    index: int
    id: str | None  # set on a call's first delta only
    name: str | None  # set on a call's first delta only
    arguments: str  # the next piece of the arguments JSON text ("" allowed on the first)


class StreamDelta(NamedTuple):
    content: str  # content text to send now ("" if none)
    tool_calls: list[ToolCallDelta]


def make_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def partial_tag_len(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper prefix of ``tag``: text that
    may still become the tag and must be held back."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Call:
    __slots__ = ("announced", "arguments", "complete", "id", "name", "pending")

    def __init__(self, name: str) -> None:
        self.id = make_call_id()
        self.name = name
        self.arguments: list[str] = []
        self.complete = False
        self.announced = False  # its first delta (id and name) has been handed out
        self.pending: list[str] = []  # argument text not yet handed out


class ToolCallStream:
    """One choice's parsing state: ``feed`` it each new piece of generated text, ``finish`` it at
    the end. Subclasses implement ``_advance`` over ``self._text``, the whole text so far."""

    def __init__(self) -> None:
        self._text = ""
        self._finished = False
        self._calls: list[_Call] = []
        self._content: list[str] = []  # content not yet handed out
        self._held_space = ""  # trailing whitespace of the content: dropped if a call comes next
        self._after_call = False  # nothing but whitespace since the last call

    def feed(self, delta_text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._text += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """Flushes what was held back: a partial tag becomes content, an unfinished call stays a
        call with the arguments it has."""
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            if self._held_space and not self._after_call:
                self._content.append(self._held_space)
            self._held_space = ""
        return self._take()

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls whose arguments are complete; after ``finish``, every call begun."""
        return [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self._calls
                if c.complete or self._finished]

    def _advance(self, final: bool) -> None:
        """Consume as much of ``self._text`` as can be decided; with ``final``, all of it."""
        raise NotImplementedError

    # What a format's stream reports, in text order.

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            self._content.append(self._held_space + body)
            self._held_space = ""
            self._after_call = False
        self._held_space += text[len(body):]

    def _start_call(self, name: str) -> None:
        self._held_space = ""
        self._after_call = True
        self._calls.append(_Call(name))

    def _emit_arguments(self, text: str) -> None:
        if text:
            call = self._calls[-1]
            call.arguments.append(text)
            call.pending.append(text)

    def _complete_call(self) -> None:
        self._calls[-1].complete = True

    def _take(self) -> StreamDelta:
        content = "".join(self._content)
        self._content.clear()
        deltas = []
        for index, call in enumerate(self._calls):
            if call.announced and not call.pending:
                continue
            piece = "".join(call.pending)
            call.pending.clear()
            if call.announced:
                deltas.append(ToolCallDelta(index, None, None, piece))
            else:
                call.announced = True
                deltas.append(ToolCallDelta(index, call.id, call.name, piece))
        return StreamDelta(content, deltas)


class ToolParser:
    """A model family's tool-call output format."""

    name: ClassVar[str]
    stream_class: ClassVar[type[ToolCallStream]]
    # Whether the format's markers are special tokens, which the engine's text must then keep.
    reads_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole generated text: the stream's answer for the text in one piece."""
        stream = self.stream()
        content = stream.feed(text).content + stream.finish().content
        return ExtractedToolCalls(content or None, stream.tool_calls)

    def stream(self) -> ToolCallStream:
        """A fresh streaming state, one per choice."""
        return self.stream_class()
