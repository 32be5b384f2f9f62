"""The simulated engine's tokens (``EngineArgs.simulate``): drawn from a seeded generator, with no
logits, so the host spends on a token what it would beside a real GPU, not a pass over the
vocabulary.

The simulated model is sure of one token at each step, drawn uniformly over the tokenizer's ids:
a seeded sequence's from its (seed, index, output position), as a real seeded row's
(``seeding``); a greedy one's from its last token and length, so the same prompt gives the same
output and ``n`` greedy sequences are equal; any other from the engine's generator (seeded by
``EngineArgs.seed``). Before ``min_tokens``, an EOS or stop id drawn is drawn again; the EOS and
stop ids drawn after that end the sequence by the engine's own rules (``ignore_eos`` included).
A row with a grammar or asking for logprobs goes through the real sampler, over logits that put
all but no mass on the drawn token: its grammar then picks among the tokens it allows.
"""

from __future__ import annotations

import random

import torch

from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.model_executor.simulated_runner import SimulatedForward, sleep_until
from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sample.sampler import Drawn, Sampler, SamplerOutput
from pagefleet.worker.sample.seeding import draw_key, splitmix64

# The drawn token's logit over the others' 0: e^40 outweighs any vocabulary.
SURE_LOGIT = 40.0


class SimulatedSampler:
    def __init__(self, eos_token_ids: tuple[int, ...], num_token_ids: int, logits_width: int, seed: int) -> None:
        """``num_token_ids``: the ids drawn, 0 .. num_token_ids - 1 (the tokenizer's);
        ``logits_width``: the model's vocabulary, for the rows that go through the real sampler."""
        self.eos_token_ids = list(eos_token_ids)
        self.num_token_ids = num_token_ids
        self.logits_width = logits_width
        self.rng = random.Random(seed)
        self.sampler = Sampler(eos_token_ids)

    def __call__(self, forward: SimulatedForward, seqs: list[Sequence]) -> SamplerOutput:
        """``forward``: the step as the simulated runner queued it; its tokens exist once it is done."""
        return self.collect(self.draw(forward, seqs), seqs)

    def draw(self, forward: SimulatedForward, seqs: list[Sequence]) -> Drawn:
        """As the real sampler's: nothing to queue (the simulated runner reads no input ids)."""
        return Drawn(None, forward)

    def collect(self, drawn: Drawn, seqs: list[Sequence]) -> SamplerOutput:
        """Wait for the simulated step, then draw its tokens."""
        sleep_until(drawn.pending.ready_at)
        tokens = [self.draw_token(seq) for seq in seqs]
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        full = [i for i, s in enumerate(seqs) if s.grammar is not None or s.params.logprobs is not None]
        if full:
            sure = torch.zeros(len(full), self.logits_width)  # [F, V]
            sure[torch.arange(len(full)), torch.tensor([tokens[i] for i in full])] = SURE_LOGIT
            out = self.sampler(sure, [seqs[i] for i in full])
            for row, i in enumerate(full):
                tokens[i], logprobs[i] = out.token_ids[row], out.logprobs[row]
        return SamplerOutput(tokens, logprobs)

    def draw_token(self, seq: Sequence) -> int:
        p = seq.params
        if p.seed is not None:
            key = draw_key(p.seed, seq.index, seq.num_output_tokens)
        elif p.greedy:
            key = draw_key(seq.token_ids[-1], seq.num_tokens, 0)
        else:
            key = self.rng.getrandbits(64)
        token = key % self.num_token_ids
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            while token in banned:
                key = splitmix64(key)
                token = key % self.num_token_ids
        return token
