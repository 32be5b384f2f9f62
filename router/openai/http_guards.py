"""What an HTTP request body must be before anything parses it: JSON, not too big, not too deep.

Each guard refuses with an OpenAI-shaped error (``OpenAIError``) and does its work
in C where it can (header checks, ``bytes.count``, one regex search), so a hostile
body costs little: a body over the size limit is refused from its Content-Length
or as soon as the bytes read pass the limit; nesting and lone surrogates are
looked for only when a cheap scan of the raw bytes says they could be there.
Only JSON is accepted (415 otherwise): a browser can post ``text/plain`` or a
form to any site without asking first, but not ``application/json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from starlette.requests import Request

from pagefleet.router.openai.errors import OpenAIError, bad_request

# Whole numbers up to this size become ints (a seed is the widest integer a request holds).
_WIDEST_INT = 2**64
MAX_JSON_DEPTH = 32  # the deepest request pagefleet reads is 4 levels (messages[i].content[j].text)
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Bodies up to this size are parsed on the event loop (too short to stall it); larger ones on a thread.
INLINE_PARSE_BYTES = 64 * 2**10
# The client's address as the HTTP front saw it: HAProxy sets it on every request (whatever the
# client sent), since every request reaches the ingress from HAProxy's own address. A client
# that reaches the ingress directly can claim any address here; the bounds it keys (a worker's
# grammar compile queue per client) still sit under bounds over every client.
CLIENT_ADDRESS_HEADER = "X-Pagefleet-Client"


def client_address(peer: str, headers) -> str:
    """Whose share of per-client bounds a request takes: the front's word, else its peer."""
    return headers.get(CLIENT_ADDRESS_HEADER) or peer

_JSON_MEDIA_TYPE = re.compile(r"application/(?:[\w.+-]+\+)?json")
# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): a pair decodes to one character, a lone one
# stays a surrogate that no UTF-8 encoder (the tokenizer's included) accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(slots=True, frozen=True)
class BodyLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def check_content_type(request: Request) -> None:
    """415 unless the body is declared as (UTF-8) JSON, uncompressed."""
    declared = request.headers.get("content-type")
    if declared is None:
        raise _unsupported_media("a request body needs 'Content-Type: application/json'")
    media_type, *params = [part.strip() for part in declared.split(";")]
    if not _JSON_MEDIA_TYPE.fullmatch(media_type.lower()):
        raise _unsupported_media(f"Content-Type {media_type[:100]!r} is not supported; send "
                                 "'Content-Type: application/json'")
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise _unsupported_media("JSON bodies must be UTF-8 (charset=utf-8)")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise _unsupported_media(f"Content-Encoding {encoding[:50]!r} is not supported")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it is known to be longer than ``max_bytes``."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(length) > max_bytes:
            raise _too_large(int(length), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object; 400 for anything JSON or UTF-8 does not allow (NaN, lone
    surrogates, invalid bytes) and for nesting deeper than ``MAX_JSON_DEPTH``."""
    try:
        # Decoded strictly here: json.loads(bytes) would let UTF-8-encoded surrogates through.
        data: Any = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_json_number)
    except RecursionError:
        raise bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"could not parse the JSON body of the request: {_short(exc)}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if deep or surrogates:
        _check_tree(data, deep, surrogates)
    return data


def _check_tree(data: dict, check_depth: bool, check_strings: bool) -> None:
    """Walk the parsed body without recursion: depth, and strings that are not valid Unicode text."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if check_depth and depth > MAX_JSON_DEPTH:
            raise bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", _param(path))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if check_strings and isinstance(key, str) and not _is_text(key):
                raise bad_request("a JSON key holds a lone UTF-16 surrogate, which is not text", _param(path))
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path + (key,)))
            elif check_strings and isinstance(value, str) and not _is_text(value):
                raise bad_request("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                                  _param(path + (key,)))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _param(path: tuple) -> str | None:
    """OpenAI's spelling of a path into the body: ``messages.[0].content``."""
    if not path:
        return None
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path)


def _json_number(text: str) -> int | float:
    """A JSON number written with a fraction or exponent: an int when its value is whole (``5.0``,
    ``1e2``), as JSON Schema counts it, so a client's ``"max_tokens": 5.0`` is the integer 5."""
    value = float(text)
    if value.is_integer() and abs(value) <= _WIDEST_INT:
        exact = Decimal(text)  # float(text) may have rounded 5.0000000000000001 to 5.0
        if exact == exact.to_integral_value():
            return int(exact)
    return value


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which JSON (and OpenAI) do not.
    raise ValueError(f"{name} is not valid JSON")


def _short(exc: Exception) -> str:
    return str(exc)[:200]


def _too_large(size: int, max_bytes: int) -> OpenAIError:
    return OpenAIError(f"the request body is {size} bytes or more; this server accepts at most {max_bytes} "
                       "(max_request_body_bytes)", status_code=413, code="request_too_large")


def _unsupported_media(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=415, code="unsupported_media_type")
