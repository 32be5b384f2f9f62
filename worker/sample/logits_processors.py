"""A request's logits processors, as vLLM's: ``allowed_token_ids`` (only these may be sampled),
``bad_words`` (a word may not be completed) and ``logit_bias`` (added to a token's logit), in
that order, on the logits' device, for every row of a step at once.

They change what is sampled, not the logprobs reported (those are the model's, as vLLM's
default). They run before penalties, grammars and min_tokens, as in vLLM's sampler."""

from __future__ import annotations

import torch

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.sample.device_copies import to_device


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it would start the text and, where that tokenizes differently, as
    it would follow a space (vLLM's rule: the spaced form counts where its first token differs
    and its length is the same)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue  # a word the tokenizer writes with no token cannot be generated either
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def banned_by_bad_words(words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word after ``output_token_ids``: a one-token word's
    token always, a longer word's last token where the output ends with the rest of it."""
    banned = []
    for ids in words:
        prefix = ids[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            banned.append(ids[-1])
    return banned


def wants_processing(seq: Sequence) -> bool:
    p = seq.params
    return p.logit_bias is not None or p.allowed_token_ids is not None or bool(p.bad_words)


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence], tokenizer) -> None:
    """In place. logits: [S, V], one row per sequence of ``seqs``."""
    allowed_rows: list[int] = []
    allowed_ids: list[int] = []
    banned: tuple[list[int], list[int]] = ([], [])
    biased: tuple[list[int], list[int], list[float]] = ([], [], [])
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.allowed_token_ids is not None:
            allowed_rows += [row] * len(p.allowed_token_ids)
            allowed_ids += p.allowed_token_ids
        if p.bad_words:
            if seq.bad_words_ids is None:
                seq.bad_words_ids = bad_words_token_ids(tokenizer, p.bad_words)
            ids = banned_by_bad_words(seq.bad_words_ids, seq.token_ids[seq.num_prompt_tokens:])
            banned[0].extend([row] * len(ids))
            banned[1].extend(ids)
        if p.logit_bias:
            biased[0].extend([row] * len(p.logit_bias))
            biased[1].extend(p.logit_bias)
            biased[2].extend(p.logit_bias.values())
    device = logits.device
    if allowed_rows:
        rows = sorted(set(allowed_rows))
        local = {row: i for i, row in enumerate(rows)}
        keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
        keep[_ids([local[r] for r in allowed_rows], device), _ids(allowed_ids, device)] = True
        index = _ids(rows, device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if banned[0]:
        logits[_ids(banned[0], device), _ids(banned[1], device)] = float("-inf")
    if biased[0]:
        values = to_device(biased[2], logits.dtype, device)
        logits.index_put_((_ids(biased[0], device), _ids(biased[1], device)), values, accumulate=True)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
