"""``pagefleet bench``'s datasets, built with the tiny checkpoint's tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagefleet.cluster.bench.datasets import file_requests, length_range, random_requests, shared_prefix_requests


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_random_prompts_have_the_lengths_they_claim(tok):
    reqs = random_requests(tok, 20, input_len=40, output_len=10, range_ratio=0.5, seed=7)
    assert len(reqs) == 20
    assert length_range(40, 0.5) == (20, 60) and length_range(10, 0.5) == (5, 15)
    for r in reqs:
        assert len(encode(tok, r.prompt)) == r.prompt_len
        assert 20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15
    assert len({r.prompt_len for r in reqs}) > 1  # lengths vary with a range ratio
    fixed = random_requests(tok, 5, 32, 8, 0.0, seed=7)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(32, 8)] * 5
    assert random_requests(tok, 5, 32, 8, 0.0, seed=7) == fixed  # same seed, same prompts
    assert random_requests(tok, 5, 32, 8, 0.0, seed=8) != fixed
    with pytest.raises(ValueError, match="range ratio must be in"):
        random_requests(tok, 1, 32, 8, 1.0, seed=0)


def test_shared_prefix_tenants_share_their_prefix_tokens(tok):
    reqs = shared_prefix_requests(tok, num_tenants=3, questions_per_tenant=4, prefix_len=48, question_len=16,
                                  output_len=7, seed=1)
    assert len(reqs) == 12 and {r.output_len for r in reqs} == {7}
    prefixes: dict[str, list] = {}
    for r in reqs:
        prefixes.setdefault(r.prompt.split("\n")[0], []).append(encode(tok, r.prompt))
    assert sorted(len(v) for v in prefixes.values()) == [4, 4, 4]
    for ids in prefixes.values():
        common = 0
        while all(len(x) > common and x[common] == ids[0][common] for x in ids):
            common += 1
        assert common >= 47  # the prefix, less at most its last token merging with the newline
    first_tenant = [next(k for k, v in prefixes.items() if encode(tok, r.prompt) in v) for r in reqs]
    assert first_tenant != sorted(first_tenant, key=first_tenant.index)  # tenants interleave


def test_file_jsonl_and_sharegpt(tok, tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_len": 5}\n\n{"prompt": "general kenobi"}\n')
    reqs = file_requests(jsonl, tok, num_prompts=4, output_len=None, seed=0)
    assert sorted({(r.prompt, r.output_len) for r in reqs}) == [("general kenobi", 256), ("hello there", 5)]
    assert len(reqs) == 4  # two records, repeated to four
    assert {r.prompt_len for r in reqs if r.prompt == "hello there"} == {len(encode(tok, "hello there"))}

    long_reply = "word " * 50
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "tell me a long story please " * 3},
                                      {"from": "gpt", "value": long_reply}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "a reply with no question"}]},
    ]))
    reqs = file_requests(sharegpt, tok, num_prompts=2, output_len=None, seed=0)
    # "b" has turns under 4 tokens and "c" no human turn: only "a" is usable
    assert [r.prompt for r in reqs] == ["tell me a long story please " * 3] * 2
    assert reqs[0].output_len == len(encode(tok, long_reply))
    assert file_requests(sharegpt, tok, 1, output_len=9, seed=0)[0].output_len == 9

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        file_requests(bad, tok, 1, None, 0)
    (tmp_path / "noprompt.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="record 0 has neither"):
        file_requests(tmp_path / "noprompt.jsonl", tok, 1, None, 0)
    with pytest.raises(FileNotFoundError):
        file_requests(tmp_path / "missing.json", tok, 1, None, 0)
