"""Test doubles for the serving tests: a small trained tokenizer and a scripted worker.

Only tests import this; production code never sees a fake.
"""

from __future__ import annotations

import asyncio

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta, TokenLogprob
from pagefleet.worker.sampling_params import SamplingParams

MODEL = "tiny-test"
MAX_MODEL_LEN = 64

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "pagefleet serves models on ray"] * 10
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def fake_token(prompt_ids: list[int], step: int, index: int, vocab_size: int) -> int:
    """The fake model's output: a fixed function of the prompt, the step and the sequence."""
    return 2 + (prompt_ids[-1] * 7 + step * 3 + index * 11) % (vocab_size - 2)


class FakeWorkerClient:
    """Streams ``fake_token`` outputs one token per step, records every request it gets,
    and records the ones whose stream was closed before they finished (aborted)."""

    def __init__(self, tokenizer, vocab_size: int, *, num_cached_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_cached_tokens = num_cached_tokens
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.routed: list = []  # every Job asked about, before it runs
        self.refuse: Exception | None = None  # raised by route (admission control saying no)
        self.refuse_early: Exception | None = None  # raised by check_room (the admission queue full)
        self.aborted: list[str] = []
        self.healthy = True
        self.fail_after_steps: int | None = None
        self.step_gate: asyncio.Event | None = None  # when set, each step after the first waits for it
        # Like the engine: sequence i stops ("stop") after max_tokens - i tokens, and a finished
        # sequence keeps appearing, empty, in its request's later deltas.
        self.stagger = False

    def expected_tokens(self, prompt_ids: list[int], params: SamplingParams, index: int) -> list[int]:
        return [fake_token(prompt_ids, s, index, self.vocab_size) for s in range(params.max_tokens)]

    def check_room(self) -> None:
        if self.refuse_early is not None:
            raise self.refuse_early

    async def route(self, job) -> list[str] | None:
        self.routed.append(job)
        if self.refuse is not None:
            raise self.refuse
        return None

    async def generate(self, job):
        request_id, prompt_token_ids, params = job.request_id, job.token_ids, job.params
        self.requests.append((request_id, list(prompt_token_ids), params))
        finished = False
        try:
            for step in range(params.max_tokens):
                if self.fail_after_steps is not None and step == self.fail_after_steps:
                    raise RuntimeError("engine step failed")
                if step > 0 and self.step_gate is not None:
                    await self.step_gate.wait()
                await asyncio.sleep(0)
                last = step == params.max_tokens - 1
                seqs = []
                for i in range(params.n):
                    own_len = max(1, params.max_tokens - i) if self.stagger else params.max_tokens
                    if step >= own_len:
                        seqs.append(CompletionOutput(i, "", [], [] if params.logprobs is not None else None, "stop"))
                        continue
                    own_last = step == own_len - 1
                    tok = fake_token(prompt_token_ids, step, i, self.vocab_size)
                    logprobs = None
                    if params.logprobs is not None:
                        top = [(tok, -0.5), (tok + 1, -1.5), (tok + 2, float("-inf"))][:params.logprobs]
                        logprobs = [TokenLogprob(tok, -0.5, top)]
                    reason = None if not own_last else ("length" if own_len == params.max_tokens else "stop")
                    seqs.append(CompletionOutput(i, self.tokenizer.decode([tok]), [tok], logprobs, reason))
                finished = last
                yield RequestOutputDelta(request_id, seqs, len(prompt_token_ids), self.num_cached_tokens, last)
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("engine stopped stepping")
