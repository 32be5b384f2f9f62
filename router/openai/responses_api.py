"""``POST /v1/responses`` (OpenAI's Responses API) as a chat completion.

A Responses request becomes a ``ChatCompletionRequest`` (``instructions`` a system message first,
``input`` the messages, ``max_output_tokens`` the ``max_tokens``, function tools one level down)
and runs on the chat path: the same template, tool parser, sampling and admission;
``output.response_events`` shapes the chat answer into a Response. This server stores nothing,
so what needs a stored response (``store: true``, ``previous_response_id``, ``background``) is
refused, and so is every other field it does not honour: a 400 naming it, never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagefleet.router.openai.errors import OpenAIError, bad_request, from_validation_error, unsupported
from pagefleet.router.openai.protocol import ChatCompletionRequest, ResponsesInputItem, ResponsesRequest

# Fields of OpenAI's Responses request that this server does not honour, with the value that
# asks for nothing (accepted, as is null); any other value is refused naming the field.
DEFAULTS: dict[str, Any] = {
    "previous_response_id": None, "background": False, "conversation": None, "include": [],
    "truncation": "disabled", "text": {"format": {"type": "text"}}, "metadata": None, "reasoning": None,
    "max_tool_calls": None, "top_logprobs": None, "service_tier": "auto", "prompt": None,
    "prompt_cache_key": None, "safety_identifier": None, "user": None, "stream_options": None,
}
STORED = ("previous_response_id", "background", "conversation")  # what only a stored response can give

# Chat fields as the Responses API names them, for errors raised on the chat path.
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input"}


def check_fields(req: ResponsesRequest) -> None:
    """A 400 naming the first field this server would otherwise ignore."""
    if req.store:
        raise unsupported("store: true is not supported: this server stores no responses (send store: false)",
                          "store")
    for name, value in (req.model_extra or {}).items():
        if value is None or (name in DEFAULTS and value == DEFAULTS[name]):
            continue
        if name in STORED:
            raise unsupported(f"{name} is not supported: this server stores no responses", name)
        raise unsupported(f"{name} is not supported by this server's /v1/responses", name)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``req`` (checked by ``check_fields`` first)."""
    check_fields(req)
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        if not req.input:
            raise bad_request("input must hold at least one item", "input")
        for i, item in enumerate(req.input):
            _append_item(messages, i, item)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.stream:  # the usage goes into response.completed
        body["stream_options"] = {"include_usage": True}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
    if isinstance(req.tool_choice, str):
        body["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise renamed(from_validation_error(exc)) from exc


# The fields each kind of input item holds (``id`` and ``status``, which an earlier answer gave
# it, are not read); another one set is refused.
_ITEM_FIELDS = {"message": {"role", "content"}, "function_call": {"call_id", "name", "arguments"},
                "function_call_output": {"call_id", "output"}}


def _append_item(messages: list[dict], i: int, item: ResponsesInputItem) -> None:
    where = f"input.[{i}]"
    stray = next((name for name in item.model_fields_set - _ITEM_FIELDS[item.type] - {"type", "id", "status"}
                  if getattr(item, name) is not None), None)
    if stray is not None:
        raise bad_request(f"{where}: a {item.type} item has no {stray}", f"{where}.{stray}")
    if item.type == "message":
        if item.role is None or item.content is None:
            field = "role" if item.role is None else "content"
            raise bad_request(f"{where}: a message needs role and content", f"{where}.{field}")
        content = item.content if isinstance(item.content, str) else [
            {"type": "text", "text": part.text} for part in item.content]
        messages.append({"role": item.role, "content": content})
    elif item.type == "function_call":
        for field in ("call_id", "name", "arguments"):
            if getattr(item, field) is None:
                raise bad_request(f"{where}: a function_call needs {field}", f"{where}.{field}")
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:  # calls of one turn
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    else:
        if item.call_id is None or item.output is None:
            field = "call_id" if item.call_id is None else "output"
            raise bad_request(f"{where}: a function_call_output needs {field}", f"{where}.{field}")
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})


def renamed(exc: OpenAIError) -> OpenAIError:
    """An error of the chat path, naming its field as the Responses request does."""
    if exc.param is None:
        return exc
    head, dot, rest = exc.param.partition(".")
    if head == "tools":  # a Responses tool holds its function's fields itself
        exc.param = exc.param.replace(".function.", ".")
        return exc
    name = _PARAM_NAMES.get(head)
    if name is None:
        return exc
    if head == "messages":  # its message indices shift with instructions: the input as a whole
        exc.param = name
    else:
        exc.message, exc.param = exc.message.replace(head, name), name + dot + rest
    return exc


def echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a Response repeats."""
    if req.tool_choice is None:
        tool_choice: str | dict = "auto" if req.tools else "none"
    else:
        tool_choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False}
