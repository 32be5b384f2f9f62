"""Compile a request's ``structured_outputs`` into an xgrammar grammar: on a small thread pool of
its own, under a time limit, once per distinct spec (a bounded LRU of compiled grammars).

Compiling never runs on the caller's event loop nor on the engine's step thread: callers wait on
the pool (``compile`` blocks, ``compile_async`` awaits) before the request reaches the scheduler.
A spec xgrammar refuses, or one that does not compile in time, is an ``InvalidRequest`` naming
``structured_outputs`` (a 400 at the ingress), never an engine error.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import NamedTuple

import xgrammar as xgr

from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept, least recently used dropped first once either bound is passed. A JSON
# schema's grammar holds token masks over the vocabulary: megabytes for a large one.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_BYTES = 256 << 20
COMPILE_THREADS = 2
# JSON may be laid out freely, but a run of whitespace in it is at most this many characters:
# enough to indent 7 levels of 4 spaces, and a model cannot loop on newlines until max_tokens.
JSON_MAX_WHITESPACE = 32
# xgrammar's messages start with a timestamp and its C++ source file: not for a client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarKey(NamedTuple):
    kind: str  # the StructuredOutputsParams field that is set
    spec: str  # that field's text (choices: their EBNF grammar)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    if kind == "json_object":
        return GrammarKey(kind, "")
    if kind == "choice":
        return GrammarKey(kind, choice_grammar(params.choice))
    return GrammarKey(kind, getattr(params, kind))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``, each taken literally. JSON's string
    escapes are those of xgrammar's EBNF literals (unescaped non-ASCII: its literals take no
    surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class CacheInfo(NamedTuple):
    hits: int
    misses: int  # each one compile
    size: int  # grammars kept, compiled or compiling
    bytes: int  # of the compiled ones


class GrammarCache:
    """Compiled grammars of one tokenizer, shared by every request of an engine (thread-safe).

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (a padded embedding): a grammar's bitmask then masks the ids past the tokenizer.
    ``stop_token_ids`` end a complete grammar (the model's EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_entries: int = GRAMMAR_CACHE_SIZE,
                 max_bytes: int = GRAMMAR_CACHE_BYTES, threads: int = COMPILE_THREADS) -> None:
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use, on the pool
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()
        # A spec's future, not its result: a spec asked for again while compiling waits on the same
        # compile, and a compile that outlives its waiter's time limit still fills the cache.
        self._entries: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._sizes: dict[GrammarKey, int] = {}  # bytes of each compiled entry
        self._bytes = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pagefleet-grammar")
        self.hits = 0
        self.misses = 0

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._entries), self._bytes)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compile of ``params``' grammar: cached, in flight, or started now on the pool."""
        key = grammar_key(params)
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile_and_count, key)
            self._entries[key] = future
            self._evict()
            return future

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Block until ``params``' grammar is compiled (on the pool); InvalidRequest if it cannot be."""
        future = self.submit(params)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._timed_out(params) from None
        except Exception as e:
            raise _refused(params, e) from None

    async def compile_async(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """``compile`` for an event loop: awaits the pool, never blocks the loop."""
        future = self.submit(params)
        try:
            # shield: this waiter's time limit must not cancel a compile other requests share.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timed_out(params) from None
        except Exception as e:
            raise _refused(params, e) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_and_count(self, key: GrammarKey) -> xgr.CompiledGrammar:
        compiled = self._compile(key)
        with self._lock:  # before the future resolves: a waiter sees the cache with its grammar in
            if key in self._entries and key not in self._sizes:
                self._sizes[key] = compiled.memory_size_bytes
                self._bytes += self._sizes[key]
                self._evict()
        return compiled

    def _evict(self) -> None:
        # Under self._lock. The most recent grammar stays, however large.
        while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and len(self._entries) > 1):
            key, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)

    def _timed_out(self, params: StructuredOutputsParams) -> InvalidRequest:
        return InvalidRequest(f"structured_outputs.{params.kind} did not compile within {self.timeout_s:g} s",
                              "structured_outputs")

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        if key.kind in ("json", "json_object"):
            schema = json.loads(key.spec) if key.kind == "json" else {"type": "object"}
            return compiler.compile_json_schema(json.dumps(_length_bounds_as_patterns(schema)),
                                                max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if key.kind == "regex":
            return compiler.compile_regex(key.spec)
        return compiler.compile_grammar(key.spec)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Reading the tokenizer's vocabulary takes a while on a large one: only once a request asks.
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # This cache is the one cache; each compile on one thread, beside the step loop's.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


# Keywords whose values are JSON data, not subschemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _length_bounds_as_patterns(schema):
    """``schema`` with each plain string's minLength/maxLength spelled as a pattern of as many
    characters. xgrammar lowers a length-bounded string to a character class that lets raw control
    characters through (invalid JSON; mlc-ai/xgrammar#800), while its pattern path keeps to JSON's
    string syntax. Either way a bounded string holds no escape sequences."""
    if isinstance(schema, list):
        return [_length_bounds_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _length_bounds_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[\\s\\S]{{{low},{high}}}$"
    return out


def _refused(params: StructuredOutputsParams, error: Exception) -> InvalidRequest:
    if isinstance(error, InvalidRequest):
        return error
    message = _XGRAMMAR_PREFIX.sub("", str(error).strip()) or type(error).__name__
    return InvalidRequest(f"structured_outputs.{params.kind} does not compile: {message}", "structured_outputs")
