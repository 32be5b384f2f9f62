"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens
before it, and the most likely tokens at its position, from the logits of the positions a step
computes (``step_input.prompt_logprob_spans``)."""

from __future__ import annotations

import torch

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sample.device_copies import to_device


@torch.inference_mode()
def score_prompts(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
    """Fill ``seq.prompt_logprobs[j + 1]`` for each span's positions j: the logits at position j
    score prompt token j + 1. The model's own logprobs (no penalty, bias or grammar applies to a
    prompt).

    logits: [R, V], one row per position of the spans, in their order."""
    targets = [seq.token_ids[j + 1] for seq, first, stop in spans for j in range(first, stop)]
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_t = logprobs.gather(1, to_device(targets, torch.long, logits.device).unsqueeze(1))  # [R, 1]
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    top_values = top_values.tolist() if k else None
    top_ids = top_ids.tolist() if k else None
    row = 0
    for seq, first, stop in spans:
        n = seq.params.prompt_logprobs
        for j in range(first, stop):
            top = list(zip(top_ids[row][:n], top_values[row][:n])) if n else []
            seq.prompt_logprobs[j + 1] = TokenLogprob(targets[row], chosen[row], top, ranks[row])
            row += 1
