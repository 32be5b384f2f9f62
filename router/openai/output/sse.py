"""Server-sent events exactly as OpenAI writes them.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
An error after the response has started (status 200 is already sent) is one
``data: {"error": {...}}`` event, then ``[DONE]``.
"""

from __future__ import annotations

from typing import AsyncIterator

import msgspec

from pagefleet.router.openai.errors import OpenAIError, internal_error

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode  # compact UTF-8, as json.dumps(separators=(",", ":"), ensure_ascii=False)


def sse_event(payload: dict) -> bytes:
    # bytes, not str: the response writes them as they are (a streamed token's chunk is encoded once)
    return b"data: " + _encode(payload) + b"\n\n"


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Formats chunks as events, turning a failure into an error event before ``[DONE]``."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except OpenAIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:  # the client already has a 200; the error must travel in the stream
        yield sse_event(internal_error(exc).body())
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    yield DONE



async def sse_typed_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """The Responses API's events: each named by an ``event:`` line (its ``type``), and no
    ``[DONE]`` (the last event says the response ended). ``events`` reports its own errors."""
    async for payload in events:
        yield b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)
