"""The engine on Triton kernels (PAGEFLEET_KERNELS=triton: the interpreter on CPU) produces the
same greedy tokens as on the PyTorch twins, through chunked prefill, prefix-cache hits and decode."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("triton")

from pagefleet.kernels import ops  # noqa: E402
from pagefleet.kernels.triton_kernel import TritonKernel  # noqa: E402
from pagefleet.worker import LLM, SamplingParams  # noqa: E402

MAX_NEW = 5


def _generate(checkpoint, prompts_text):
    # 24-token steps: the 40-token prompts prefill in chunks, mixed with other rows' decode.
    llm = LLM(model=str(checkpoint), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
              max_num_batched_tokens=24, max_num_seqs=4)
    shared = llm.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)[:33]
    first = [shared + llm.tokenizer.encode(t) for t in prompts_text[:2]]
    second = [shared + llm.tokenizer.encode(prompts_text[2]), llm.tokenizer.encode(prompts_text[3])]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in first], params)
    # Served after the first batch: its shared 32-token prefix (two blocks) is a cache hit.
    outs += llm.generate([{"prompt_token_ids": p} for p in second], params)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_triton_engine_matches_twins(tiny_checkpoint, monkeypatch):
    checkpoint = tiny_checkpoint("llama")
    texts = ["alpha beta", "gamma", "delta epsilon zeta", "one two three four five"]

    monkeypatch.setenv(ops.ENV_VAR, "torch")
    torch_tokens, torch_cached = _generate(checkpoint, texts)

    launches = Counter()
    real_on = TritonKernel.on

    def counting_on(self, device):
        launches[self.__name__] += 1
        return real_on(self, device)

    monkeypatch.setattr(TritonKernel, "on", counting_on)
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    triton_tokens, triton_cached = _generate(checkpoint, texts)

    assert triton_tokens == torch_tokens
    assert all(len(t) == MAX_NEW for t in triton_tokens)
    assert triton_cached == torch_cached and triton_cached[2] == 32  # the prefix hit happened on both
    # Every model op ran as a Triton kernel: 2 layers x (attention, KV write, rotary, SiLU, 2 norms) per step.
    assert set(launches) == {"_paged_attention_kernel", "_write_kv_cache_kernel", "_rotary_kernel",
                             "_silu_and_mul_kernel", "_rms_norm_kernel"}
    assert launches["_paged_attention_kernel"] == launches["_write_kv_cache_kernel"] > 0
