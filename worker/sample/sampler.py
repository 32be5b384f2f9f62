"""Turn each sampling row's logits into its next token (plus logprobs when asked)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sample.device_copies import to_device, to_host_async
from pagefleet.worker.sample.logits_processors import apply_logits_processors, wants_processing
from pagefleet.worker.sample.seeding import PositionKeyedDraws
from pagefleet.worker.structured.matcher import GrammarMasker

logger = logging.getLogger(__name__)

class SamplerOutput(NamedTuple):
    # None for a row that had no token to sample (every logit masked, NaN or infinite): its
    # sequence ends there (``Scheduler.append_sampled``), its batch-mates go on.
    token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]


class Drawn(NamedTuple):
    """A step's tokens as sampled on the device, before the host has them."""

    tokens: torch.Tensor | None  # [S] on the logits' device; None where the device makes no tokens (simulated)
    # What the sampler's collect reads: the host copies on their way and the event that says
    # they are there (to_host_async); for the simulated sampler, the simulated step.
    pending: object


class PenaltyState:
    """What a sequence's penalties read, kept on the logits' device and brought up to date with the
    tokens added since the last step: a step costs the new tokens and one pass over the vocabulary,
    never the whole context."""

    __slots__ = ("seen", "counts", "marked")

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] in prompt or output
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [V] output occurrences
        self.marked = 0  # leading token_ids already counted in

    def catch_up(self, seq: Sequence) -> None:
        new = seq.token_ids[self.marked:]
        if not new:
            return
        ids = to_device(new, torch.long, self.seen.device)
        self.seen[ids] = True
        outputs = max(0, len(seq.token_ids) - max(self.marked, seq.num_prompt_tokens))
        if outputs:
            self.counts.index_add_(0, ids[-outputs:], torch.ones(outputs, device=self.counts.device))
        self.marked = len(seq.token_ids)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition penalty over prompt and output (as transformers applies it); presence and
    frequency penalties over output tokens only (as OpenAI defines them). In place.

    logits: [S, V], one row per sequence of ``seqs``."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
            continue
        if seq.penalties is None:
            seq.penalties = PenaltyState(logits.shape[-1], logits.device)
        state = seq.penalties
        state.catch_up(seq)
        if p.repetition_penalty != 1.0:
            vals = logits[row]
            penalized = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            logits[row] = torch.where(state.seen, penalized, vals)
        if p.presence_penalty or p.frequency_penalty:
            logits[row] -= p.frequency_penalty * state.counts + p.presence_penalty * (state.counts > 0)


def mask_to_support(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside the top-k, then outside the top-p nucleus (smallest
    set of most likely tokens whose mass reaches top_p), then below min_p * max prob.

    logits: [R, V]; top_k: [R] int (0 = off); top_p, min_p: [R] float. Returns a new tensor.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always stays
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def in_vocabulary(tokens: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` with every row that had no token to sample set to id 0, and which rows had one.

    A row has none when every logit is -inf (a grammar that allows nothing, a mask that failed),
    or NaN or +inf: argmax then picks a token whose logit is not finite, and the inverse CDF
    finds no token (``searchsorted`` returns ``vocab_size``). Id 0 keeps every use of the ids on
    the device in range (the logprob gather, the embedding of a step launched ahead) until the
    host ends the row's sequence. One gather: O(rows), not O(rows x vocab).

    tokens: [S] int64; logits: [S, V], as masked for sampling. Returns ([S] int64, [S] bool)."""
    vocab = logits.shape[-1]
    clamped = tokens.clamp(max=vocab - 1)
    valid = (tokens < vocab) & logits.gather(1, clamped.unsqueeze(1)).squeeze(1).isfinite()
    return clamped.masked_fill(~valid, 0), valid


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer=None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer  # for bad_words (logits_processors)
        self.mask_to_grammars = GrammarMasker()
        self.seeded_draws = PositionKeyedDraws()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [S, V] fp32, one row per sequence that samples this step
        return self.collect(self.draw(logits, seqs), seqs)

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> Drawn:
        """Queue the sampling of ``logits`` (one row per sequence of ``seqs``) on their device: the
        tokens stay there (``Drawn.tokens``, which the next step can read before the host has
        them); ``collect`` brings them over."""
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        processed = any(map(wants_processing, seqs))
        penalized = any(s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty
                        for s in seqs)
        if processed or penalized:
            logits = logits.clone()
        if processed:
            apply_logits_processors(logits, seqs, self.tokenizer)
        if penalized:
            apply_penalties(logits, seqs)
        # Before temperature and the support masks, so greedy and random rows alike draw only
        # tokens their grammar accepts; logprobs stay the model's own (raw_logprobs above).
        # A row whose sequence has ended (in the step before, launched ahead of it) is dropped;
        # its grammar may have accepted its end and take no more.
        self.mask_to_grammars(logits, [None if s.is_finished else s.grammar for s in seqs])
        self._mask_early_stops(logits, seqs)

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            rows = to_device(random_rows, torch.long, logits.device)
            tokens.index_copy_(0, rows, self._sample(logits.index_select(0, rows), [seqs[i] for i in random_rows]))
        tokens, valid = in_vocabulary(tokens, logits)
        # What the host will read, on its way now: the tokens and which rows had one; with
        # logprobs, each token's own and the most likely ones (as many as the most any row asks for).
        out = [tokens, valid]
        if want_logprobs:
            out.append(raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))
            k = max(s.params.logprobs or 0 for s in seqs)
            if k:
                out.extend(reversed(raw_logprobs.topk(k, dim=-1)))  # ids, then values
        return Drawn(tokens, to_host_async(out))

    def collect(self, drawn: Drawn, seqs: list[Sequence]) -> SamplerOutput:
        """The drawn tokens on the host (the step's one device-to-host copy), with their logprobs."""
        values, ready = drawn.pending
        if ready is not None:
            ready.synchronize()
        token_list: list[int | None] = values[0].tolist()
        for i, ok in enumerate(values[1].tolist()):
            if not ok:
                token_list[i] = None
                logger.warning("request %s: no token of its row could be sampled (every logit masked by its "
                               "grammar or min_tokens, or not finite); its sequence ends", seqs[i].request_id)
        chosen, top_ids, top_values = [v.tolist() for v in values[2:]] + [None] * (5 - len(values))
        out_logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None or token_list[i] is None:
                continue
            top = list(zip(top_ids[i][:n], top_values[i][:n])) if n else []
            out_logprobs[i] = TokenLogprob(token_list[i], chosen[i], top)
        return SamplerOutput(token_list, out_logprobs)

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before min_tokens are out, EOS and stop token ids cannot be sampled, unless a grammar
        allows nothing else: a complete grammar ends the sequence whatever min_tokens says."""
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if not banned:
                    continue
                banned = to_device(banned, torch.long, logits.device)
                if seq.grammar is None:
                    logits[row, banned] = float("-inf")
                    continue
                kept = logits[row].clone()
                logits[row, banned] = float("-inf")
                if not torch.isfinite(logits[row]).any():
                    logits[row] = kept

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # logits: [R, V] -> [R] token ids
        dev = logits.device
        temps = to_device([s.params.temperature for s in seqs], logits.dtype, dev)
        logits = logits / temps.unsqueeze(1)
        if any(s.params.top_k or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in seqs):
            logits = mask_to_support(
                logits,
                to_device([s.params.top_k for s in seqs], torch.long, dev),
                to_device([s.params.top_p for s in seqs], logits.dtype, dev),
                to_device([s.params.min_p for s in seqs], logits.dtype, dev),
            )
        # Inverse CDF: one uniform per row, found in the row's cumulative distribution. (An
        # exponential race, argmax(p / E) with E ~ Exp(1), draws the same distribution but
        # needs a random number per vocabulary entry, slower on CPU.) The sums run
        # in float64 so that rounding moves no token's share measurably; u lies in (0, total],
        # so a token of probability 0 (outside top-k/top-p) is never found. A seeded row's
        # uniform is keyed by its seed, index and output position (``seeding``), so neither
        # batch-mates nor a continuation on another replica can shift its stream.
        cdf = (logits - logits.amax(dim=-1, keepdim=True)).exp_().to(torch.float64).cumsum_(dim=-1)
        u = 1.0 - torch.rand(len(seqs), 1, dtype=torch.float64)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None:
                u[row] = self.seeded_draws.uniform(seq.params.seed, seq.index, seq.num_output_tokens)
        if dev.type == "cuda":
            u = u.pin_memory().to(dev, non_blocking=True)
        u = u * cdf[:, -1:]
        return torch.searchsorted(cdf, u).squeeze(1)  # u <= total: never past the last token
