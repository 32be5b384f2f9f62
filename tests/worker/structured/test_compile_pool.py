"""Grammar compiles as bounded work (CompilePool under GrammarCache): a compile past its time limit
is killed, not only given up on; cheap compiles are not queued behind a flood of expensive ones;
the queue is bounded per client and in all, refusing at once."""

from __future__ import annotations

import os
import time

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from pagefleet.worker.errors import CompileQueueFull
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import StructuredOutputsParams
from pagefleet.worker.structured.grammar_cache import GrammarCache

from structured_helpers import expensive_schema

EOS = (2, 4)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(EOS[0]) and matcher.is_terminated()


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
    return value


def test_a_compile_past_the_limit_is_killed_and_the_next_compiles_at_once(tokenizer):
    cache = GrammarCache(tokenizer, 1000, EOS, timeout_s=1.0, quick_s=0.5, long_slots=1)
    try:
        cache.compile(StructuredOutputsParams(regex="warm"))  # the compile server is up
        slow = expensive_schema("k")
        future = cache.submit(slow)
        (pid,) = wait_for(cache.pool.running_pids)
        with pytest.raises(InvalidRequest) as info:
            cache.compile(slow)
        assert (str(info.value), info.value.param) == ("structured_outputs.json did not compile within 1 s",
                                                       "structured_outputs")
        assert future.done()
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 5.0)  # killed and reaped: its CPU is free
        assert cache.pool.running_pids() == []
        assert accepts(cache.compile(StructuredOutputsParams(regex="fast")), "fast")
        with pytest.raises(InvalidRequest, match="did not compile within 1 s"):  # refused again, not recompiled
            cache.compile(slow)
        assert cache.cache_info()[:3] == (2, 3, 3)
    finally:
        cache.shutdown()


def test_a_cheap_compile_does_not_wait_behind_a_flood_of_expensive_ones(tokenizer):
    # Two quick slots, one long: of a flood, one compile goes on in the long slot, the others are
    # killed once they outrun the quick slot; another client's compile takes the next quick slot.
    cache = GrammarCache(tokenizer, 1000, EOS, timeout_s=30.0, quick_s=1.0, quick_slots=2, long_slots=1)
    try:
        cache.compile(StructuredOutputsParams(regex="warm"))
        flood = [cache.submit(expensive_schema(tag), client="flood") for tag in "wxyz"]
        started = time.monotonic()
        assert accepts(cache.compile(StructuredOutputsParams(regex="cheap"), client="other"), "cheap")
        waited = time.monotonic() - started
        assert not flood[0].done()  # still compiling in the long slot
        for future in flood[1:]:
            error = future.exception(timeout=30)
            assert isinstance(error, CompileQueueFull)
            assert str(error) == ("the grammar took over 1 s to compile while the 1 slots for long compiles "
                                  "were taken")
        assert waited < 3.0, waited  # one quick slot's turn, not the flood's four
    finally:
        cache.shutdown()


def test_the_queue_refuses_at_once_past_its_bound_per_client_and_in_all(tokenizer):
    cache = GrammarCache(tokenizer, 1000, EOS, timeout_s=30.0, quick_s=30.0, quick_slots=1, long_slots=0,
                         max_per_client=2, max_queued=3)
    try:
        a = [cache.submit(expensive_schema(tag), client="a") for tag in "ab"]  # one running, one queued
        wait_for(cache.pool.running_pids)
        with pytest.raises(CompileQueueFull) as info:
            cache.submit(expensive_schema("c"), client="a")
        assert str(info.value) == "this client has 2 grammars compiling or queued, the most it may"
        b = [cache.submit(expensive_schema(tag), client="b") for tag in "de"]  # queued: 3 in all
        with pytest.raises(CompileQueueFull) as info:
            cache.compile(StructuredOutputsParams(regex="x"), client="c")
        assert str(info.value) == "3 grammars are queued to compile, the most there may be"
        assert cache.cache_info().size == 4  # the refused specs were not kept
        assert not any(f.done() for f in a + b)
    finally:
        cache.shutdown()
    assert all(isinstance(f.exception(), RuntimeError) for f in a + b)
