"""GrammarCache (compile once per spec, on its pool, within a time limit, refusals as InvalidRequest)
and GrammarMasker (one bitmask over the constrained rows, padded vocabulary masked), without a model."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import StructuredOutputsParams
from pagefleet.worker.structured.grammar_cache import GrammarCache, choice_grammar
from pagefleet.worker.structured.matcher import GrammarMasker, SequenceGrammar

EOS = (2, 4)  # the demo checkpoints' <|endoftext|> and <|im_end|>
TOKENIZER_VOCAB = 1000  # the tiny demo tokenizer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
def cache(tokenizer):
    cache = GrammarCache(tokenizer, TOKENIZER_VOCAB, EOS)
    yield cache
    cache.shutdown()


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """Whether ``text`` followed by EOS is a whole sentence of the grammar."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(EOS[0]) and matcher.is_terminated()


def test_a_spec_compiles_once_and_later_requests_hit_the_cache(cache):
    schema = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    first = cache.compile(schema)
    for _ in range(3):  # equal specs in new objects: the same compiled grammar
        assert cache.compile(StructuredOutputsParams(json=schema.json)) is first
    assert cache.cache_info()[:3] == (3, 1, 1)  # hits, misses, size
    cache.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert cache.cache_info()[:3] == (3, 2, 2)


def test_the_least_recently_used_grammar_leaves_a_full_cache(tokenizer):
    cache = GrammarCache(tokenizer, TOKENIZER_VOCAB, EOS, max_entries=2)
    try:
        a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
        cache.compile(a)
        cache.compile(b)
        cache.compile(a)  # a is now the most recent
        cache.compile(c)  # b goes
        assert cache.cache_info()[:3] == (1, 3, 2)
        cache.compile(a)
        assert cache.cache_info()[:3] == (2, 3, 2)
        cache.compile(b)  # compiled again
        assert cache.cache_info()[:3] == (2, 4, 2)
    finally:
        cache.shutdown()


def test_compiled_grammars_are_dropped_past_the_byte_bound(tokenizer):
    specs = [StructuredOutputsParams(regex=r) for r in ("a+@x", "b+@y", "c+@z")]
    sizes = []
    probe = GrammarCache(tokenizer, TOKENIZER_VOCAB, EOS)
    try:
        for spec in specs:
            sizes.append(probe.compile(spec).memory_size_bytes)
        assert probe.cache_info() == (0, 3, 3, sum(sizes))
        assert len(set(sizes)) == 1  # alike grammars: any two fit the bound below, three do not
    finally:
        probe.shutdown()
    cache = GrammarCache(tokenizer, TOKENIZER_VOCAB, EOS, max_bytes=sizes[0] + sizes[1])
    try:
        for spec in specs:
            cache.compile(spec)
        assert cache.cache_info() == (0, 3, 2, sizes[1] + sizes[2])  # the oldest went
        cache.compile(specs[0])
        assert cache.cache_info() == (0, 4, 2, sizes[2] + sizes[0])
    finally:
        cache.shutdown()


@pytest.mark.parametrize("kwargs,message", [
    ({"json": '{"type": "nope"}'}, 'structured_outputs.json does not compile: Unsupported type "nope"'),
    ({"json": "false"}, "structured_outputs.json does not compile: Schema 'false' cannot accept any value"),
    ({"regex": "(ab"}, "structured_outputs.regex does not compile: Regex parsing error at position 4: "
                       "The parenthesis is not closed."),
    ({"grammar": "root ::= item\n"}, 'structured_outputs.grammar does not compile: EBNF parser error at line 1, '
                                     'column 10: Rule "item" is not defined'),
    ({"regex": "[^\\s\\S]"}, "structured_outputs.regex allows no output at all (its language is empty)"),
    ({"grammar": 'root ::= root "a"'}, "structured_outputs.grammar allows no output at all (its language is empty)"),
])
def test_what_xgrammar_refuses_is_an_invalid_request_without_its_source_paths(cache, kwargs, message):
    spec = StructuredOutputsParams(**kwargs)
    for attempt in (lambda: cache.compile(spec), lambda: asyncio.run(cache.compile_async(spec))):
        with pytest.raises(InvalidRequest) as info:
            attempt()
        assert (str(info.value), info.value.param) == (message, "structured_outputs")


def test_a_choice_grammar_takes_every_string_literally(cache):
    choices = ["a b", "x-y", "c.d*", "(p)|q", 'quote"\\', "tab\there", "é ü 😀", "new\nline", "ctl\x01"]
    compiled = cache.compile(StructuredOutputsParams(choice=choices))
    for c in choices:
        assert accepts(compiled, c), c
    for not_one in ["a", "a bx-y", "cxd", "p", "quote", "é ü"]:
        assert not accepts(compiled, not_one), not_one
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'


def test_a_length_bounded_json_string_refuses_raw_control_characters(cache):
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4}},
              "required": ["name"]}
    compiled = cache.compile(StructuredOutputsParams(json=json.dumps(schema)))
    assert accepts(compiled, '{"name": "ab"}')
    assert accepts(compiled, '{"name": "abcd"}')
    assert not accepts(compiled, '{"name": "a"}')
    assert not accepts(compiled, '{"name": "abcde"}')
    assert not accepts(compiled, '{"name": "a\tb"}')  # xgrammar's own bounded string takes this


def test_the_masker_leaves_only_the_grammars_tokens_and_masks_the_padded_vocabulary(tokenizer):
    padded = 1024  # the logits are wider than the tokenizer
    cache = GrammarCache(tokenizer, padded, EOS)
    try:
        digit = cache.compile(StructuredOutputsParams(regex="[0-9]"))
    finally:
        cache.shutdown()
    logits = torch.randn(3, padded, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    GrammarMasker()(logits, [None, SequenceGrammar(digit), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # unconstrained rows
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    single_digits = [i for i in range(TOKENIZER_VOCAB) if tokenizer.decode([i]) in set("0123456789")]
    assert len(single_digits) == 10
    assert allowed == single_digits
    assert torch.equal(logits[1, allowed], before[1, allowed])  # survivors untouched


def test_a_grammar_accepts_the_tokens_it_is_given_and_ends_at_eos(cache, tokenizer):
    grammar = SequenceGrammar(cache.compile(StructuredOutputsParams(choice=["yes"])))
    for token in tokenizer.encode("yes"):
        grammar.accept(token)
    assert not grammar.done
    grammar.accept(EOS[1])
    assert grammar.done and grammar.rejected_token is None
    refusing = SequenceGrammar(cache.compile(StructuredOutputsParams(choice=["yes"])))
    refusing.accept(tokenizer.encode("no")[0])
    assert refusing.done and refusing.rejected_token == tokenizer.encode("no")[0]


@pytest.mark.parametrize("schema,message", [
    ({"not": {}}, '"not" at $: xgrammar does not enforce it'),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     '"allOf" at $: xgrammar enforces an allOf of exactly one schema only'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}},
     '"if" at $: xgrammar does not enforce it'),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
     '"dependentSchemas" at $: xgrammar does not enforce it'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, '"dependentRequired" at $: xgrammar does not enforce it'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     '"uniqueItems" at $: xgrammar does not enforce it'),
    ({"type": "array", "contains": {"const": 5}}, '"contains" at $: xgrammar does not enforce it'),
    ({"type": "number", "multipleOf": 0.5}, '"multipleOf" at $: xgrammar enforces only a whole multipleOf of '
                                            '"type" integer'),
    ({"minimum": 3}, '"minimum" at $: xgrammar enforces it only beside "type" integer or number'),
    ({"pattern": "^a$"}, '"pattern" at $: xgrammar enforces it only beside "type" string'),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "iri"}}},
     "\"format\" at $.properties.when: xgrammar does not enforce the format 'iri'"),
    ({"anyOf": [{"type": "integer"}], "maximum": 3}, "\"maximum\" at $: xgrammar ignores it beside 'anyOf'"),
    ({"type": "string", "enum": ["a", 1]}, "\"type\" at $: xgrammar ignores it beside 'enum'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]},
     '"oneOf" at $: xgrammar enforces oneOf as anyOf, and two of its schemas may match one value (give them '
     'distinct types, consts or a const tag)'),
    ({"type": "array", "items": {"type": "object", "properties": {"x y": {"not": {"type": "null"}}}}},
     "\"not\" at $.items.properties['x y']: xgrammar does not enforce it"),
])
def test_a_keyword_xgrammar_does_not_enforce_is_refused_with_its_path(schema, message):
    with pytest.raises(InvalidRequest) as info:
        StructuredOutputsParams(json=json.dumps(schema))
    assert (str(info.value), info.value.param) == (f"structured_outputs.json uses {message}", "structured_outputs")


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "integer", "multipleOf": 3}, "9", "4"),
    ({"type": "object", "patternProperties": {"^x.*$": {"type": "integer"}}}, '{"xa": 1}', '{"xa": "s"}'),
    ({"type": "object", "propertyNames": {"pattern": "^a+$"}, "additionalProperties": {"type": "integer"}}, '{"aa": 1}', '{"b": 1}'),
    ({"type": "string", "format": "date"}, '"2024-01-31"', '"hello"'),
    ({"allOf": [{"type": "integer", "minimum": 2}], "description": "one member"}, "2", "1"),
    ({"type": "string", "enum": ["a", "b"]}, '"a"', '"c"'),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "n": {"type": "integer"}},
                 "required": ["k", "n"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
     '{"k": "b"}', '{"k": "c"}'),
])
def test_a_keyword_xgrammar_enforces_is_kept_and_holds(cache, schema, good, bad):
    compiled = cache.compile(StructuredOutputsParams(json=json.dumps(schema)))
    assert accepts(compiled, good) and not accepts(compiled, bad)
