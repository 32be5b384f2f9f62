"""Compile a request's ``structured_outputs`` into an xgrammar grammar: in a process of its own,
under a time limit that kills the compile (``compile_pool``), once per distinct spec (a bounded LRU
of compiled grammars).

Compiling never runs on the caller's event loop nor on the engine's step thread: callers wait on
the pool (``compile`` blocks, ``compile_async`` awaits) before the request reaches the scheduler.
A spec xgrammar refuses, one whose language is empty, or one that does not compile in time, is an
``InvalidRequest`` naming ``structured_outputs`` (a 400 at the ingress), never an engine error; a
full compile queue is ``CompileQueueFull`` (a 429).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import NamedTuple

import xgrammar as xgr

from pagefleet.worker.errors import CompileQueueFull
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import StructuredOutputsParams
from pagefleet.worker.structured.compile_pool import COMPILE_TIMEOUT_S, CompilePool, CompileTimeout, EmptyLanguage

# Compiled grammars kept, least recently used dropped first once either bound is passed. A JSON
# schema's grammar holds token masks over the vocabulary: megabytes for a large one.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_BYTES = 256 << 20
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
    ``stop_token_ids`` end a complete grammar (the model's EOS ids). ``pool_options``: the
    compile pool's bounds (``CompilePool``)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_entries: int = GRAMMAR_CACHE_SIZE,
                 max_bytes: int = GRAMMAR_CACHE_BYTES, **pool_options) -> None:
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._info: xgr.TokenizerInfo | None = None  # built on first use, off the caller's thread
        self._info_lock = threading.Lock()
        self._lock = threading.Lock()
        # A spec's future, not its result: a spec asked for again while compiling waits on the same
        # compile. A refusal stays (the spec is refused again at once); a full queue does not.
        self._entries: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._sizes: dict[GrammarKey, int] = {}  # bytes of each compiled entry
        self._bytes = 0
        self.pool = CompilePool(lambda: self.tokenizer_info().serialize_json(), timeout_s=timeout_s, **pool_options)
        self.hits = 0
        self.misses = 0

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._entries), self._bytes)

    def submit(self, params: StructuredOutputsParams, client: str = "") -> Future:
        """The compile of ``params``' grammar: cached, in flight, or queued now. ``client``: who
        asks (the queue holds a bounded number of compiles per client). Raises CompileQueueFull."""
        key = grammar_key(params)
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future
            future = self.pool.submit(key.kind, key.spec, client, lambda text: self._stored(key, text))
            self.misses += 1
            self._entries[key] = future
            self._evict()
        future.add_done_callback(lambda f: self._forget_if_transient(key, f))
        return future

    def compile(self, params: StructuredOutputsParams, client: str = "") -> xgr.CompiledGrammar:
        """Block until ``params``' grammar is compiled; InvalidRequest if it cannot be,
        CompileQueueFull if the queue is full."""
        future = self.submit(params, client)
        try:
            return future.result()  # the pool ends every compile by its time limit
        except Exception as e:
            raise self._error(params, e) from None

    async def compile_async(self, params: StructuredOutputsParams, client: str = "") -> xgr.CompiledGrammar:
        """``compile`` for an event loop: awaits the pool, never blocks the loop."""
        future = self.submit(params, client)
        try:
            # shield: a waiter that goes away must not cancel a compile other requests share.
            return await asyncio.shield(asyncio.wrap_future(future))
        except Exception as e:
            raise self._error(params, e) from None

    def shutdown(self) -> None:
        self.pool.shutdown()

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        # Reading the tokenizer's vocabulary takes a while on a large one: only once a request asks.
        with self._info_lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                                stop_token_ids=self._stop_token_ids)
            return self._info

    def _stored(self, key: GrammarKey, text: str) -> xgr.CompiledGrammar:
        compiled = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info())
        with self._lock:  # before the future resolves: a waiter sees the cache with its grammar in
            if key in self._entries and key not in self._sizes:
                self._sizes[key] = compiled.memory_size_bytes
                self._bytes += self._sizes[key]
                self._evict()
        return compiled

    def _forget_if_transient(self, key: GrammarKey, future: Future) -> None:
        error = future.exception()
        if isinstance(error, CompileQueueFull) or (isinstance(error, CompileTimeout) and error.queued):
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]

    def _evict(self) -> None:
        # Under self._lock. The most recent grammar stays, however large.
        while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and len(self._entries) > 1):
            key, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)

    def _error(self, params: StructuredOutputsParams, error: Exception) -> Exception:
        where = f"structured_outputs.{params.kind}"
        if isinstance(error, CompileTimeout) and error.queued:
            return CompileQueueFull(f"{where} waited {self.timeout_s:g} s for a compile slot; retry later")
        if isinstance(error, CompileTimeout):
            return InvalidRequest(f"{where} did not compile within {self.timeout_s:g} s", "structured_outputs")
        if isinstance(error, EmptyLanguage):
            return InvalidRequest(f"{where} allows no output at all (its language is empty)", "structured_outputs")
        if isinstance(error, (CompileQueueFull, InvalidRequest)):
            return error
        message = _XGRAMMAR_PREFIX.sub("", str(error).strip()) or type(error).__name__
        return InvalidRequest(f"{where} does not compile: {message}", "structured_outputs")
