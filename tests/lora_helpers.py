"""Tiny PEFT adapters over a tiny checkpoint, and transformers + PEFT's greedy output on them."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# name -> (r, lora_alpha, use_rslora, target modules, seed)
ADAPTERS = {
    "sql": (4, 8, False, ["q_proj", "v_proj"], 1),
    "chat": (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
    "code": (2, 4, False, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 3),
}


def write_adapter(base: Path, out: Path, r: int, alpha: int, rslora: bool, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter over ``base`` with random, non-zero A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B small enough that the adapters steer, not swamp, the tiny model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(base: str, adapter: str | None, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers (+ PEFT's adapter, unmerged) greedy continuation, EOS treated as any token."""
    return peft_greedy_top5(base, adapter, prompt_ids, max_new_tokens)[0]


@functools.lru_cache(maxsize=64)
def peft_greedy_top5(base: str, adapter: str | None, prompt_ids: tuple[int, ...],
                     max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """``peft_greedy``, and each step's top-5 ids (DESIGN.md's criterion)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = list(prompt_ids)
    top5 = []
    with torch.no_grad():
        for _ in range(max_new_tokens):  # no KV cache: the plainest reference
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            top5.append(set(logits.topk(5).indices.tolist()))
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):], top5
