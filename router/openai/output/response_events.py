"""A chat completion's answer as a Responses API ``response`` object, whole or as stream events.

The output items, in order: the reasoning (with ``--reasoning-parser``), a ``message`` holding
the text as one ``output_text`` part (left out when the answer is only tool calls), then one
``function_call`` per call the tool parser found. A choice cut off by ``max_tokens`` makes the
response ``incomplete`` (reason ``max_output_tokens``). Streamed, each item opens with
``response.output_item.added`` and closes with ``response.output_item.done``, its text between as
deltas, every event numbered by ``sequence_number``, as OpenAI's stream and its client have them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from pagefleet.router.openai.errors import OpenAIError, internal_error


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShaper:
    """Builds one Response from its chat completion. ``echo``: the request's fields the Response
    repeats (instructions, max_output_tokens, temperature, top_p, tools, tool_choice, ...)."""

    def __init__(self, *, model: str, echo: dict[str, Any]) -> None:
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo

    def body(self, status: str, output: list[dict], usage: dict | None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage, "store": False, "background": False, "truncation": "disabled",
                "text": {"format": {"type": "text"}}, "metadata": None, **self.echo}

    def response(self, chat: dict) -> dict:
        """The whole Response of a chat completion's body (one choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(_message_item(_id("msg"), message.get("content") or "", _status(choice)))
        output += [_call_item(_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                              "completed") for call in calls]
        return self.body(_status(choice), output, response_usage(chat["usage"]))

    def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """Stream events of a streamed chat completion (with its usage chunk)."""
        return _EventStream(self).run(chunks)


class _EventStream:
    """The state of one streamed response: the items so far, the one open, the next number."""

    def __init__(self, shaper: ResponseShaper) -> None:
        self.shaper = shaper
        self.sequence_number = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item receiving deltas
        self.texts: dict[str, str] = {}  # item id -> its text (or arguments) so far
        self.calls: dict[int, dict] = {}  # the chat stream's tool call index -> its item

    def event(self, type_: str, **fields: Any) -> dict:
        out = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    async def run(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        shaper = self.shaper
        yield self.event("response.created", response=shaper.body("in_progress", [], None))
        yield self.event("response.in_progress", response=shaper.body("in_progress", [], None))
        status, usage = "completed", None
        try:
            async for chunk in chunks:
                if chunk.get("usage"):
                    usage = response_usage(chunk["usage"])
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    if delta.get("reasoning_content"):
                        for e in self._text("reasoning", delta["reasoning_content"]):
                            yield e
                    if delta.get("content"):
                        for e in self._text("message", delta["content"]):
                            yield e
                    for call in delta.get("tool_calls") or []:
                        for e in self._call(call):
                            yield e
                    if choice["finish_reason"] is not None:
                        status = _status(choice)
        except OpenAIError as exc:
            yield self.event("error", code=exc.code, message=exc.message, param=exc.param)
            return
        except Exception as exc:  # the 200 is sent: the error travels in the stream
            error = internal_error(exc)
            yield self.event("error", code=error.code, message=error.message, param=None)
            return
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            for e in self._open("message"):  # an empty answer is still a message
                yield e
        for e in self._close(status):
            yield e
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self.event(final, response=shaper.body(status, self.output, usage))

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close("completed") + self._open(kind)
        item = self.open
        self.texts[item["id"]] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(name, item_id=item["id"], output_index=len(self.output) - 1, content_index=0,
                                    delta=text, **extra)]

    def _call(self, call: dict) -> list[dict]:
        events = []
        if call.get("id") is not None:  # a call's first entry
            events += self._close("completed")
            item = _call_item(_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
            self.calls[call["index"]] = item
            events += self._add(item)
        item = self.calls[call["index"]]
        if item is not self.open:  # parsers send each call whole before the next; never reopened
            raise RuntimeError("a tool call's arguments came after the next item began")
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self.texts[item["id"]] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=len(self.output) - 1, delta=arguments))
        return events

    def _open(self, kind: str) -> list[dict]:
        item_id = _id("msg" if kind == "message" else "rs")
        item = _message_item(item_id, None, "in_progress") if kind == "message" else \
            _reasoning_item(item_id, None, "in_progress")
        events = self._add(item)
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=len(self.output) - 1,
                                     content_index=0, part=_text_part("")))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        self.texts[item["id"]] = ""
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self, status: str) -> list[dict]:
        """Ends the open item (``status``: how the response ended, for a message cut short)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, text = len(self.output) - 1, self.texts[item["id"]]
        kind, events = item["type"], []
        if kind == "message":
            done = _message_item(item["id"], text, status)
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=_text_part(text)))
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text, "completed")
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=text))
        self.output[index] = done
        return events + [self.event("response.output_item.done", output_index=index, item=done)]


def response_usage(usage: dict) -> dict:
    """A chat completion's usage as the Responses API counts it."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            # the reasoning's tokens are not counted apart (they are in output_tokens)
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _status(choice: dict) -> str:
    return "incomplete" if choice["finish_reason"] == "length" else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    """``text`` None: an item just opened, with no part yet."""
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
