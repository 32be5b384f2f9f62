"""The model step compiled with torch.compile (Inductor), split around attention as vLLM does.

Dynamo captures the whole decoder as one graph in which attention is a single opaque
custom op, ``pagefleet::flex_paged_attention`` (KV write + paged FlexAttention). So
the batch's composition (how many rows, how long, which blocks) never reaches the
compiled graph: its only varying size is the token count T, compiled once for any T
(``backed_size_oblivious``: T = 1 is no special case). The op reads the step's
``FlexPlan``, built once per step on the host, from ``attention_plan``, a context
that refuses nesting.

Compiled code is cached across starts by Inductor's own caches, kept under
``~/.cache/pagefleet/inductor`` (``$PAGEFLEET_CACHE``) unless TORCHINDUCTOR_CACHE_DIR
says otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from pagefleet.kernels.flex_paged_attention import FlexPlan, build_plan, compile_settings, flex_paged_attention

_plan: FlexPlan | None = None


@contextlib.contextmanager
def attention_plan(plan: FlexPlan) -> Iterator[None]:
    """Make ``plan`` the layout every attention layer of this forward pass uses."""
    global _plan
    if _plan is not None:
        raise RuntimeError("attention_plan is already set: one forward pass at a time")
    _plan = plan
    try:
        yield
    finally:
        _plan = None


@torch.library.custom_op("pagefleet::flex_paged_attention", mutates_args=("key_cache", "value_cache"))
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float) -> torch.Tensor:
    # query: [T, Hq, D]; key, value: [T, Hkv, D]; caches: [N, bs, Hkv, D]; slot_mapping: [T] -> [T, Hq, D]
    if _plan is None:
        raise RuntimeError("pagefleet::flex_paged_attention ran outside attention_plan")
    # The engine never pads slot_mapping, so no negative-slot filter (and no host sync) here.
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
    return flex_paged_attention(query, key, value, key_cache, value_cache, _plan, scale)


@paged_attention_op.register_fake
def _(query, key, value, key_cache, value_cache, slot_mapping, scale):
    return torch.empty_like(query)


def compile_cache_dir() -> str:
    root = os.environ.get("PAGEFLEET_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagefleet"))
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(root, "inductor")


class CompiledModel:
    """``model``'s forward compiled for any token count, attention through paged FlexAttention."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                 device: torch.device) -> None:
        # Read when Inductor first touches its cache, so this must run before the first compile.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
        self.forward = torch.compile(model, dynamic=True, fullgraph=True)
        self.block_size = block_size
        self.max_q_len = max_num_batched_tokens
        with torch.inference_mode():  # as every step will see it: no recompile on the second step
            self.block_pos = torch.zeros(num_blocks, dtype=torch.int32, device=device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches,
                 query_start_loc: list[int], seq_lens: list[int]) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, H]; meta.block_table: [B, M]
        plan = build_plan(meta.block_table, query_start_loc, seq_lens, self.block_size, self.block_pos,
                          self.max_q_len)
        with attention_plan(plan), compile_settings():
            return self.forward(input_ids, positions, meta, kv_caches)
