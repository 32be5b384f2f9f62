"""Grammar-constrained decoding through the engine, on random weights: only the grammar makes an
output valid, so every output must be a sentence of its grammar, whatever the seed and temperature,
with n > 1, preemption by recompute, prefix-cache hits, stop strings, min_tokens and a vocabulary
padded past the tokenizer's."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import jsonschema
import pytest
import xgrammar as xgr

from pagefleet.worker import LLM, AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from pagefleet.worker.model_executor.model_config import load_model_config
from pagefleet.worker.request_check import InvalidRequest

from structured_helpers import expensive_schema

EOS = (2, 4)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
SUM_GRAMMAR = 'root ::= "(" num ("+" num){0,4} ")"\nnum ::= [1-9] [0-9]{0,2}'
SUM_LANGUAGE = r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,4}\)"
PROMPTS = ["Give me a person as JSON.", "the quick brown fox"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint(arch="llama"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    llm = LLM(model=checkpoint, dtype="float32", kv_cache_bytes=32 << 20)
    yield llm
    llm.shutdown()


def constrained(temperature: float = 1.0, seed: int | None = 0, max_tokens: int = 1500, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def assert_ends_at_eos(out) -> None:
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids[-1] in EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate(llm, temperature, seed):
    outputs = llm.generate(PROMPTS, constrained(temperature, seed, json=json.dumps(PERSON)))
    for out in (o.outputs[0] for o in outputs):
        jsonschema.validate(json.loads(out.text), PERSON)  # json.loads is strict: no raw control characters
        assert_ends_at_eos(out)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_ebnf_outputs_are_in_their_languages(llm, temperature):
    choices = ["yes", "no", "maybe so", 'it "depends"']
    for seed in (0, 1, 2):
        email, choice, total = (o.outputs[0] for o in llm.generate(PROMPTS[:1] * 3, [
            constrained(temperature, seed, regex=EMAIL),
            constrained(temperature, seed, choice=choices),
            constrained(temperature, seed, grammar=SUM_GRAMMAR),
        ]))
        assert re.fullmatch(EMAIL, email.text), email.text
        assert choice.text in choices
        assert re.fullmatch(SUM_LANGUAGE, total.text), total.text
        for out in (email, choice, total):
            assert_ends_at_eos(out)


def test_json_object_outputs_are_objects_or_prefixes_of_one_cut_by_max_tokens(llm):
    # Any object allows strings of any length, which random weights may not close in 400 tokens.
    spec = StructuredOutputsParams(json_object=True)
    compiled = llm.engine.grammars.compile(spec)
    reasons = set()
    for seed in range(8):
        out = llm.generate(PROMPTS[0], constrained(1.0, seed, max_tokens=400, json_object=True))[0].outputs[0]
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in out.token_ids)  # every token was the grammar's
        reasons.add(out.finish_reason)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
            assert matcher.is_terminated()
        else:
            assert (out.finish_reason, len(out.token_ids)) == ("length", 400)
    assert reasons == {"stop", "length"}
    greedy = llm.generate(PROMPTS[0], constrained(0.0, None, json_object=True))[0].outputs[0]
    assert isinstance(json.loads(greedy.text), dict)
    assert_ends_at_eos(greedy)


def test_each_of_n_sequences_has_its_own_matcher(llm):
    params = constrained(1.0, 5, json=json.dumps(PERSON), max_tokens=1500)
    params.n = 3
    engine = llm.engine
    engine.add_request("n3", llm.tokenizer.encode(PROMPTS[0]), params)
    grammars = [seq.grammar for seq in engine.requests["n3"]]
    assert len({id(g) for g in grammars}) == 3
    engine.abort_request("n3")
    outputs = llm.generate(PROMPTS[0], params)[0].outputs
    assert [o.index for o in outputs] == [0, 1, 2]
    for out in outputs:
        jsonschema.validate(json.loads(out.text), PERSON)
        assert_ends_at_eos(out)
    assert len({o.text for o in outputs}) == 3  # separate draws, each completed by its own matcher


def test_a_complete_grammar_ends_the_output_even_with_ignore_eos(llm):
    params = constrained(1.0, 3, choice=["yes", "no"], max_tokens=50)
    params.ignore_eos = True
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert out.text in ("yes", "no")
    assert_ends_at_eos(out)
    assert len(out.token_ids) < 50


def test_a_complete_grammar_ends_the_output_before_min_tokens(llm):
    params = constrained(0.0, None, choice=["yes", "no"], max_tokens=50)
    params.min_tokens = 20
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert out.text in ("yes", "no")
    assert_ends_at_eos(out)
    assert len(out.token_ids) < 20


def test_max_tokens_cuts_a_constrained_output_short(llm):
    out = llm.generate(PROMPTS[0], constrained(1.0, 0, json=json.dumps(PERSON), max_tokens=3))[0].outputs[0]
    assert (out.finish_reason, len(out.token_ids)) == ("length", 3)
    assert out.text.lstrip().startswith("{")


def test_a_stop_string_may_end_the_output_mid_grammar_and_the_engine_serves_on(llm):
    params = constrained(1.0, 0, json=json.dumps(PERSON))
    params.stop = ['"']
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", '"')
    assert out.text.strip() == "{"
    again = llm.generate(PROMPTS[0], constrained(1.0, 0, json=json.dumps(PERSON)))[0].outputs[0]
    jsonschema.validate(json.loads(again.text), PERSON)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_prompt_served_from_the_prefix_cache_gives_the_same_constrained_output(llm):
    prompt = {"prompt_token_ids": list(range(10, 50))}  # 40 tokens: two full blocks of 16 to reuse
    params = constrained(0.0, None, regex=EMAIL)
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert re.fullmatch(EMAIL, second.outputs[0].text)


def test_preempted_sequences_recompute_without_advancing_their_matchers_twice(checkpoint):
    # 8 blocks of 16 tokens cannot hold eight growing sequences: the newest are preempted and their
    # KV recomputed from their tokens, while their matchers keep the state of those same tokens.
    cfg = load_model_config(checkpoint)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    prompts = [f"request number {i} asks for a word of letters" for i in range(8)]
    params = constrained(0.0, None, regex="[a-z]{40}", max_tokens=60)
    tight = LLM(model=checkpoint, dtype="float32", block_size=16, enable_prefix_caching=False,
                kv_cache_bytes=8 * per_block, max_model_len=128)
    try:
        assert tight.engine.pool.num_blocks == 8
        preempted = tight.generate(prompts, params)
        assert tight.engine.stats().num_preemptions > 0
        assert tight.engine.stats().num_free_blocks == 8
    finally:
        tight.shutdown()
    roomy = LLM(model=checkpoint, dtype="float32", block_size=16, kv_cache_bytes=32 << 20, max_model_len=128)
    try:
        alone = roomy.generate(prompts, params)
        assert roomy.engine.stats().num_preemptions == 0
    finally:
        roomy.shutdown()
    for got, want in zip(preempted, alone):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert re.fullmatch("[a-z]{40}", got.outputs[0].text)
        assert_ends_at_eos(got.outputs[0])


def test_ids_past_the_tokenizer_are_never_sampled_from_a_padded_vocabulary(tiny_checkpoint, tmp_path):
    # A model whose logits are 1024 wide beside the 1000-entry tokenizer of the tiny checkpoints.
    padded = tmp_path / "padded"
    shutil.copytree(tiny_checkpoint(arch="llama", vocab_size=1024), padded)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint(arch="llama") / name, padded / name)
    llm = LLM(model=str(padded), dtype="float32", kv_cache_bytes=16 << 20)
    try:
        assert (llm.engine.model_config.vocab_size, len(llm.tokenizer)) == (1024, 1000)
        free = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=0, max_tokens=200, ignore_eos=True))
        assert max(free[0].outputs[0].token_ids) >= 1000  # unconstrained, the padding is sampled
        for seed in range(3):
            out = llm.generate(PROMPTS[0], constrained(1.0, seed, json=json.dumps(PERSON)))[0].outputs[0]
            assert max(out.token_ids) < 1000
            jsonschema.validate(json.loads(out.text), PERSON)
    finally:
        llm.shutdown()


# ---- the server's engine: compiles off its event loop and its step thread, refusals per request


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = AsyncLLMEngine(EngineArgs(model=checkpoint, dtype="float32", kv_cache_bytes=16 << 20))
    yield engine
    engine.shutdown()


async def run(engine, request_id: str, prompt: str, params: SamplingParams):
    ids = engine.tokenizer.encode(prompt)
    deltas = [d async for d in engine.generate(request_id, ids, params)]
    return "".join(d.sequences[0].text for d in deltas if d.sequences), deltas[-1]


def test_the_async_engine_compiles_each_spec_once_for_requests_that_share_it(engine):
    cache = engine.engine.grammars
    before = cache.cache_info()

    async def main():
        return await asyncio.gather(*(run(engine, f"pool-{i}", PROMPTS[0], constrained(1.0, i, regex=EMAIL))
                                      for i in range(3)))

    for text, last in asyncio.run(main()):
        assert re.fullmatch(EMAIL, text)
        assert last.finished and last.sequences[0].finish_reason == "stop"
    after = cache.cache_info()
    # one spec: one compile, the other two requests shared it
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)


def test_a_refused_or_slow_grammar_fails_its_request_alone(engine, monkeypatch):
    cache = engine.engine.grammars
    monkeypatch.setattr(cache, "timeout_s", 1.5)
    monkeypatch.setattr(cache.pool, "timeout_s", 1.5)
    slow_spec = expensive_schema("s")

    async def outcome(request_id: str, params: SamplingParams):
        try:
            return await run(engine, request_id, PROMPTS[1], params)
        except InvalidRequest as e:
            return e

    async def main():
        return await asyncio.gather(
            outcome("slow", constrained(json=slow_spec.json)),
            outcome("bad", constrained(json='{"type": "nope"}')),
            outcome("plain", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
            outcome("good", constrained(choice=["left", "right"])),
        )

    slow, bad, plain, good = asyncio.run(main())
    assert (str(slow), slow.param) == ("structured_outputs.json did not compile within 1.5 s", "structured_outputs")
    assert (str(bad), bad.param) == ('structured_outputs.json does not compile: Unsupported type "nope"',
                                     "structured_outputs")
    assert plain[1].sequences[0].finish_reason == "length"
    assert good[0] in ("left", "right")
    engine.check_health()
