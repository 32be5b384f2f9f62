"""Reasoning parsers (``--reasoning-parser``, vLLM's): the text a reasoning model writes inside
``<think>...</think>`` goes to ``message.reasoning_content`` (and streamed deltas'), the rest
to ``content``; tool calls are read from the content only.

``qwen3``: the output opens a reasoning block when it starts with ``<think>`` (Qwen3 writes it
itself; with ``enable_thinking`` false its template closes an empty block in the prompt and
the output is all content). ``deepseek_r1``: the template opens the block in the prompt, so the
output is reasoning from its first character (a leading ``<think>`` is dropped). Either way the
block ends at ``</think>``; one that never closes (``max_tokens`` ran out while thinking) is
all reasoning. Split the same way whole or streamed: a tag cut across two deltas is held back
until the next one shows what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # the prompt opened the block (deepseek_r1)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> Split:
        """A whole output's (reasoning, content): reasoning None without a block, content None
        when the block took everything (as vLLM answers)."""
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return Split(reasoning if stream.opened else None, content if content or not stream.opened else None)


class Split(NamedTuple):
    reasoning: str | None
    content: str | None


PARSERS = {"qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
           "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True)}


class ReasoningStream:
    """One choice's streamed split: ``feed`` each delta's text, ``finish`` at its end."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.mode = "opening"  # then "reasoning" or "content"
        self.opened = parser.starts_in_reasoning
        self._held = ""

    def feed(self, text: str) -> Split:
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self.mode == "opening":
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    buf, self.mode, self.opened = stripped[len(START):], "reasoning", True
                elif START.startswith(stripped):  # "", "<th": too early to tell
                    self._held = buf
                    break
                else:
                    self.mode = "reasoning" if self.parser.starts_in_reasoning else "content"
            elif self.mode == "reasoning":
                end = buf.find(END)
                if end >= 0:
                    reasoning, buf, self.mode = reasoning + buf[:end], buf[end + len(END):], "content"
                    continue
                keep = _tag_prefix_at_end(buf, END)
                reasoning += buf[:len(buf) - keep]
                self._held = buf[len(buf) - keep:]
                break
            else:
                content, buf = content + buf, ""
        return Split(reasoning, content)

    def finish(self) -> Split:
        """The text held back at the output's end: where it stood, it is what it is."""
        held, self._held = self._held, ""
        if self.mode == "opening":
            self.mode = "reasoning" if self.parser.starts_in_reasoning else "content"
        return Split(held, "") if self.mode == "reasoning" else Split("", held)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag cut by the delta's end)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
