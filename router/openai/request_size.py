"""How much work a request brings, measured before the work that grows with it.

The ingress's event loop serves every client of its replica, so nothing whose cost grows with a
request runs there: what a chat template will render (messages, content parts, tools and their
schemas) is measured here first, cheaply (a walk that stops once the text is known to be long),
to decide whether it is rendered on the loop or on a thread, and exactly (before rendering) against
the prompt's character bound; a non-streamed response's size is bounded before the request runs.
"""

from __future__ import annotations

from typing import Any, Sequence

from pagefleet.router.openai.errors import bad_request
from pagefleet.router.openai.protocol import ChatMessage, ToolDefinition
from pagefleet.worker.sampling_params import SamplingParams

# A message or a tool costs at least this many characters of template work, however short its text.
ITEM_CHARS = 64
# Non-streamed responses: n x max_tokens x (1 + top_logprobs) at most this many (each token of the
# output and each of its top logprobs is one entry of the body, about 60 bytes with logprobs). At
# this size a response is about 60 MiB of JSON built in seconds on a thread.
DEFAULT_MAX_UNSTREAMED_RESPONSE_TOKENS = 1 << 20


def json_chars(value: Any, stop_after: int | None = None) -> int:
    """Characters of a JSON value's strings and keys, plus one per value (its punctuation, at
    least): a lower bound of its JSON text's length. Stops once past ``stop_after``, so the cost of
    asking whether a value is long is bounded by the answer, not by the value."""
    total = 0
    stack = [value]
    while stack:
        node = stack.pop()
        total += 1
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            for key, item in node.items():
                total += len(key) if isinstance(key, str) else 1
                stack.append(item)
                if stop_after is not None and total > stop_after:
                    return total
        elif isinstance(node, (list, tuple)):
            stack.extend(node if stop_after is None else node[:max(0, stop_after - total + 1)])
        if stop_after is not None and total > stop_after:
            return total
    return total


def message_chars(message: ChatMessage, stop_after: int | None = None) -> int:
    """Characters a message brings to the prompt: its text (its content parts', one apart) and the
    calls an assistant turn made (their names and arguments)."""
    content = message.content
    total = len(content) if isinstance(content, str) else 0
    for part in content if isinstance(content, list) else ():
        total += len(part.text or "") + 1
        if stop_after is not None and total > stop_after:
            return total
    for call in message.tool_calls or ():
        args = call.function.arguments
        left = None if stop_after is None else stop_after - total
        total += len(call.function.name) + (len(args) if isinstance(args, str) else json_chars(args, left))
        if stop_after is not None and total > stop_after:
            return total
    return total


def tool_chars(tool: ToolDefinition, stop_after: int | None = None) -> int:
    """Characters a tool brings to the prompt: its name, description and parameters' schema."""
    function = tool.function
    total = len(function.name) + len(function.description or "")
    left = None if stop_after is None else stop_after - total
    return total + json_chars(function.parameters, left)


def chat_work(messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] | None, stop_after: int) -> int:
    """Characters of template work a chat request brings, counted until past ``stop_after``: each
    message and tool costs its text and at least ``ITEM_CHARS``."""
    total = 0
    for item in (*messages, *(tools or ())):
        chars = message_chars if isinstance(item, ChatMessage) else tool_chars
        total += ITEM_CHARS + chars(item, stop_after - total)
        if total > stop_after:
            break
    return total


def check_unstreamed_size(params: Sequence[SamplingParams], limit: int, names: dict[str, str]) -> None:
    """Before a non-streamed request runs: the tokens and top logprobs its one response body
    would hold (each prompt's ``params``, ``max_tokens`` filled in) against ``limit``; a 400 naming
    ``max_tokens`` (``names``: the request's own names of SamplingParams' fields)."""
    entries = sum(p.n * p.max_tokens * (1 + (p.logprobs or 0)) for p in params)
    if entries <= limit:
        return
    first = params[0]
    max_tokens, logprobs = names.get("max_tokens", "max_tokens"), names.get("logprobs", "logprobs")
    prompts = f"{len(params)} prompts x " if len(params) > 1 else ""
    raise bad_request(f"a non-streamed response of {prompts}n={first.n} x {max_tokens}={first.max_tokens} x "
                      f"(1 + {logprobs}={first.logprobs or 0}) holds up to {entries} tokens and logprobs; this "
                      f"server builds at most {limit} in one body (max_unstreamed_response_tokens): lower n, "
                      f"{max_tokens} or {logprobs}, or set stream to true", max_tokens)
