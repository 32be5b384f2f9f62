"""Sampling: seeds, support of top-k/top-p/min-p, logprobs, penalties, n, stop conditions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.sample.sampler import Sampler, mask_to_support
from pagefleet.worker.sample.seeding import draw_key, splitmix64


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint(arch="llama")), dtype="float32", kv_cache_bytes=32 << 20)


def reference_support(logits: torch.Tensor, k: int, p: float, min_p: float) -> set[int]:
    """Obviously-correct reference: walk tokens from most to least likely."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if k:
        order = order[:k]
    probs = torch.softmax(logits[order], dim=0).tolist()
    keep, mass = [], 0.0
    for tok, pr in zip(order, probs):
        if keep and mass >= p:
            break
        keep.append(tok)
        mass += pr
    top = probs[0]
    return {t for t, pr in zip(order, probs) if t in keep and pr >= min_p * top}


@pytest.mark.parametrize("k,p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2),
                                       (7, 0.5, 0.0), (10, 0.9, 0.3), (1, 1.0, 0.0), (0, 0.01, 0.0)])
def test_top_k_top_p_min_p_keep_exactly_the_reference_support(k, p, min_p):
    gen = torch.Generator().manual_seed(k * 100 + int(p * 10))
    logits = torch.randn(3, 50, generator=gen) * 2
    masked = mask_to_support(logits, torch.tensor([k] * 3), torch.tensor([p] * 3), torch.tensor([min_p] * 3))
    for row in range(3):
        kept = set(torch.nonzero(torch.isfinite(masked[row])).flatten().tolist())
        assert kept == reference_support(logits[row], k, p, min_p)
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])  # survivors untouched


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.0, 2)])
def test_random_draws_follow_the_distribution_and_never_leave_the_support(temperature, top_k):
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5])
    rows = 40_000
    params = SamplingParams(temperature=temperature, top_k=top_k)
    seqs = [SimpleNamespace(params=params, grammar=None, is_finished=False) for _ in range(rows)]
    torch.manual_seed(0)
    drawn = Sampler(eos_token_ids=(4,))(logits.repeat(rows, 1), seqs).token_ids
    expected = (logits / temperature).softmax(dim=0)
    if top_k:  # the two most likely tokens alone, in their own proportion
        expected = torch.where(logits >= 1.0, expected, 0.0)
        expected /= expected.sum()
    counts = torch.bincount(torch.tensor(drawn), minlength=5).double()
    for tok in range(5):
        if expected[tok] == 0:
            assert counts[tok] == 0, f"token {tok} has probability 0 and was drawn {int(counts[tok])} times"
        else:  # binomial: within 5 standard deviations of rows * p
            p = float(expected[tok])
            assert abs(counts[tok] - rows * p) <= 5 * (rows * p * (1 - p)) ** 0.5, (tok, counts.tolist(), p)


def test_same_seed_same_tokens_in_any_batch_composition(llm):
    tok = llm.tokenizer
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("the seeded prompt", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (3, 20, 9)]
    batch = llm.generate(["some other text", "the seeded prompt", "x y z", "more words here"],
                         [others[0], seeded, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    reordered = llm.generate(["the seeded prompt", "x y z"], [seeded, others[1]])
    assert reordered[0].outputs[0].token_ids == alone
    different = llm.generate("the seeded prompt", SamplingParams(temperature=1.0, top_p=0.95, seed=99,
                                                                 max_tokens=16, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone
    assert len(tok.decode(alone)) > 0


def test_splitmix64_is_the_published_generator_and_draw_keys_take_seeds_as_64_bit_words():
    # SplitMix64 from state 0: its first two outputs (Steele, Lea and Flood; Vigna's reference code).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert draw_key(5, 1, 3) == splitmix64(splitmix64(splitmix64(5) ^ 1) ^ 3)
    assert draw_key(-1, 0, 0) == draw_key(2**64 - 1, 0, 0)
    keys = {draw_key(s, i, p) for s in (0, 1) for i in (0, 1) for p in (0, 1)}
    assert len(keys) == 8


def test_a_seeded_draw_is_keyed_by_seed_index_and_output_position_alone():
    """On flat logits over V tokens the drawn token is ceil(u * V) - 1, so each row's token shows
    its uniform: the one from the generator seeded with draw_key(seed, index, position)."""
    vocab = 1000

    def row(seed, index, position):
        return SimpleNamespace(params=SamplingParams(temperature=1.0, seed=seed), index=index,
                               num_output_tokens=position, grammar=None, is_finished=False)

    def expected(seed, index, position):
        u = 1.0 - torch.rand(1, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(draw_key(seed, index, position))).item()
        return math.ceil(u * vocab) - 1

    rows = [(7, 0, 0), (7, 0, 1), (7, 1, 0), (7, 0, 40), (8, 0, 0), (7, 0, 0)]
    sampler = Sampler(eos_token_ids=())
    together = sampler(torch.zeros(len(rows), vocab), [row(*r) for r in rows]).token_ids
    assert together == [expected(*r) for r in rows]
    assert together[0] == together[5]
    for r, token in zip(rows, together):  # alone, in any order: the same token
        assert sampler(torch.zeros(1, vocab), [row(*r)]).token_ids == [token]


def test_logprobs_equal_log_softmax_of_model_logits(llm):
    ids = llm.tokenizer.encode("logprobs check")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3))[0].outputs[0]
    from hf_reference import hf_model

    model = hf_model(str(llm.engine.model_config.path))
    with torch.no_grad():
        logits = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
    ref = logits.log_softmax(-1)
    assert len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-4)
        vals, top = ref[i].topk(3)
        assert [t for t, _ in lp.top] == top.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)


def test_n_sequences_share_prompt_blocks_and_differ(llm):
    ids = llm.tokenizer.encode("a prompt that is long enough to fill a few blocks of the cache " * 2)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    before = llm.engine.stats().prefix_cache_hits
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    # Children 1 and 2 reuse the parent's full prompt blocks instead of recomputing them.
    assert llm.engine.stats().prefix_cache_hits - before == 2 * ((len(ids) - 1) // 16 * 16)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_min_tokens_max_tokens_stop_token_ids(llm):
    eos = llm.engine.model_config.eos_token_ids[0]
    ids = llm.tokenizer.encode("stop conditions")
    greedy = llm.generate({"prompt_token_ids": ids},
                          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens masks EOS and stop ids until that many tokens are out.
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                                 stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert stop_at not in out.token_ids and eos not in out.token_ids


def test_repetition_penalty_changes_only_seen_tokens():
    from pagefleet.worker.core.sequence import Sequence
    from pagefleet.worker.sample.sampler import apply_penalties

    seq = Sequence(0, "r", 0, [1, 2], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                                     frequency_penalty=0.25))
    seq.append_token(3)
    seq.append_token(3)
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 5.0]])
    apply_penalties(logits, [seq])
    # token 1: 2/2; token 2: -2*2; token 3: 4/2 - (0.25*2 + 0.5); tokens 0 and 4 untouched
    assert logits.tolist() == [[1.0, 1.0, -4.0, 1.0, 5.0]]


def _penalized_from_scratch(logits: torch.Tensor, seq, rep: float, presence: float, freq: float) -> torch.Tensor:
    """The penalties' definition, over the whole context at once."""
    out = logits.clone()
    for t in set(seq.token_ids):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    outputs = seq.token_ids[seq.num_prompt_tokens:]
    for t in set(outputs):
        out[t] -= freq * outputs.count(t) + presence
    return out


def test_penalties_kept_step_by_step_equal_the_whole_context_and_count_each_token_once():
    from pagefleet.worker.core.sequence import Sequence
    from pagefleet.worker.sample.sampler import apply_penalties

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.2)
    seq = Sequence(0, "r", 0, [5, 9, 5, 2], params)
    for step, token in enumerate([9, 11, 11, 0, 5, 11]):  # repeats of prompt and output tokens
        logits = torch.randn(1, 16, generator=gen)
        want = _penalized_from_scratch(logits[0], seq, 1.7, 0.3, 0.2)
        apply_penalties(logits, [seq])
        torch.testing.assert_close(logits[0], want)
        assert seq.penalties.marked == len(seq.token_ids)  # what the next step will not count again
        seq.append_token(token)
    assert seq.penalties.counts[11].item() == 2.0  # the last 11 is not sampled from yet: counted next step


def test_bad_sampling_params_are_clear_errors():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)


def test_bad_prompts_are_clear_errors_and_leak_nothing(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, engine.model_config.vocab_size]})
    with pytest.raises(ValueError, match="maximum context length is 2048 tokens. However, your prompt has 2048"):
        llm.generate({"prompt_token_ids": [1] * engine.model_config.max_model_len})
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0


def test_out_of_range_and_non_finite_params_are_refused(llm):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=10**20)
    for name in ("temperature", "top_p", "repetition_penalty"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: float("nan")})
    with pytest.raises(ValueError, match="stop token id 1000"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(min_tokens=2, stop_token_ids=[1000]))
    assert SamplingParams(temperature=1e-40).greedy
    ids = llm.tokenizer.encode("near-zero temperature")
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tiny = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_string_before_min_tokens_does_not_cut_text(llm):
    ids = llm.tokenizer.encode("min tokens and stop strings")
    full = llm.generate({"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = full.text[2:4]  # occurs early in the greedy text
    assert len(llm.tokenizer.decode(full.token_ids[:3])) >= 4  # ...within the first few tokens
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                 min_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.text == full.text and out.token_ids == full.token_ids and out.finish_reason == "length"
