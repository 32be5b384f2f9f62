"""One streaming request of ``pagefleet bench`` to any OpenAI-compatible server, timed per chunk.

Works with ``/v1/completions`` and ``/v1/chat/completions``; asks for usage in the stream
(``stream_options.include_usage``) so output and cached token counts are the server's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from pagefleet.cluster.bench.metrics import RequestResult


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int          # tokens, as the dataset counted them
    output_len: int          # max_tokens


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # base URL + endpoint path
    model: str
    chat: bool
    headers: dict[str, str]
    extra_body: dict  # ignore_eos, temperature, ...

    def payload(self, req: BenchRequest) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        return {**body, **self.extra_body}


def _carries_tokens(choice: dict, chat: bool) -> bool:
    """A chat stream opens with a chunk that only names the assistant role (OpenAI and
    pagefleet send it before any token is generated): it starts no token clock."""
    if not chat:
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or choice.get("finish_reason"))


async def send(session: aiohttp.ClientSession, endpoint: Endpoint, req: BenchRequest, request_id: str,
               count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """Never raises for a server or network failure: it becomes ``success=False`` with the error.
    ``request_id`` goes out as the ``x-request-id`` header, as vLLM's bench sends it."""
    out = RequestResult(prompt_len=req.prompt_len)
    text: list[str] = []
    chunks = 0
    usage = None
    done = False
    out.start_time = last = time.perf_counter()
    try:
        headers = {**endpoint.headers, "x-request-id": request_id}
        async with session.post(endpoint.url, json=endpoint.payload(req), headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                out.error = f"HTTP {resp.status}: {body}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments (":" pings), event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    out.error = f"error event in the stream: {error.get('message', error) if isinstance(error, dict) else error}"
                    return out
                choices = event.get("choices") or []
                if choices and _carries_tokens(choices[0], endpoint.chat):
                    if chunks == 0:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    piece = choices[0].get("text") if not endpoint.chat else (choices[0].get("delta") or {}).get("content")
                    text.append(piece or "")
                if event.get("usage"):
                    usage = event["usage"]
    except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:  # ValueError: bad JSON in the stream
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if chunks == 0 or not done:
        out.error = "the stream ended " + ("without a token" if chunks == 0 else f"after {chunks} chunks, before [DONE]")
        return out
    out.success = True
    out.latency = last - out.start_time
    out.generated_text = "".join(text)
    if usage:
        out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
        out.output_tokens = usage.get("completion_tokens") or 0
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        out.output_tokens = count_tokens(out.generated_text) if count_tokens else chunks
    return out
