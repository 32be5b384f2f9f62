"""Greedy references from transformers on the same checkpoint, and the DESIGN.md criterion."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy continuation with its KV cache, EOS treated as any other token
    (``generate`` with min_new_tokens would mask EOS instead), and each step's top-5 ids."""
    model = hf_model(path)
    ids = torch.tensor([list(prompt_ids)])
    tokens: list[int] = []
    top5: list[set[int]] = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1]
            top5.append(set(logits.topk(5).indices.tolist()))
            tokens.append(int(logits.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **_cache_kwargs(out))
    return tokens, top5


def _cache_kwargs(out) -> dict:
    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40).
    if getattr(out, "cache", None) is not None:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def assert_greedy_close(ours: list[int], ours_top5: list[set[int]], ref: list[int], ref_top5: list[set[int]],
                        what: str) -> None:
    """DESIGN.md: equal ids, or at the first divergence each side's token is in the other's top-5
    (fp32 sums in another order can flip a near-tie); nothing after that point is compared."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert a in ref_top5[i] and b in ours_top5[i], (
                f"{what}: diverged at token {i}: ours {a} (top5 {sorted(ours_top5[i])}) vs "
                f"transformers {b} (top5 {sorted(ref_top5[i])})")
            return
