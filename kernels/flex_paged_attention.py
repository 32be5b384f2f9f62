"""Paged decode attention through PyTorch's FlexAttention, reading the KV blocks where they lie.

A layer's whole KV pool goes to ``flex_attention`` as one long key sequence of
N * bs slots (``[1, Hkv, N*bs, D]``, a view, no copy), and each decode row's
block table becomes flex's sparse block index: the row visits exactly the
physical blocks of its table, ``bs`` slots at a time. All blocks but the last
are "full" (no mask); the last, partly filled one is masked to the row's
length. Compiled, this is one fused C++ kernel (Inductor's flash-attention
template); eagerly, flex_attention would build the dense score matrix over the
whole pool, so it only ever runs compiled.

GQA is packed into the query: the ``g = Hq / Hkv`` query heads that share a KV
head are ``g`` query rows of that head (``[B, Hkv, g, D]``), so each KV block is
read once per KV head, not once per query head.

Only decode rows (one new token) come here: they are most of a busy step's
attention and all of a single stream's, and a gather of their whole contexts
(what the twin does) costs more than their attention. Rows with several new
tokens (prompts, prefill chunks) attend over their own context in the twin,
where the gather is small next to the attention work. The twin is
``reference.paged_attention``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch._inductor.config
import torch.fx.experimental._config as fx_config
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pagefleet.kernels import reference
from pagefleet.kernels.compile_cache import use_compile_cache


@dataclass(slots=True)
class DecodePlan:
    """One step's decode rows as flex_attention's block mask wants them: built once on the
    host before the forward pass, shared by every layer."""

    rows: torch.Tensor               # [B] int64: the decode rows' tokens among the step's T
    full_kv_num: torch.Tensor        # [B, 1, 1] int32: blocks before the last (no mask)
    last_kv_num: torch.Tensor        # [B, 1, 1] int32: ones (the last block, masked)
    full_kv_indices: torch.Tensor    # [B, 1, 1, N] int32: their physical ids, first full_kv_num valid
    last_kv_indices: torch.Tensor    # [B, 1, 1, N] int32: the physical id of the last block first
    last_len: torch.Tensor           # [B] int32: slots of the last block in use (1..bs)
    all_rows: bool                   # every row of the step is a decode row (rows = 0..T-1)
    multi: list[int]                 # sequences with more than one new token: the twin serves them


class DecodePlanner:
    """Builds each step's DecodePlan for a pool of ``num_blocks`` blocks of ``block_size``.

    flex_attention wants every block-index row as wide as the key sequence has blocks (the
    whole pool), though it reads only the first ``num`` entries. So the index rows live in
    two buffers of pool width kept across steps: a step writes only its tables' columns, and
    what lies beyond them (zeros, or ids from earlier steps) is never read."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._full = torch.zeros(0, num_blocks, dtype=torch.int32)
        self._last = torch.zeros(0, num_blocks, dtype=torch.int32)
        self._ones = torch.ones(0, 1, 1, dtype=torch.int32)

    def plan(self, block_table: torch.Tensor, query_start_loc: list[int], seq_lens: list[int]) -> DecodePlan | None:
        """The step's decode rows, or None if it has none (CPU tensors).

        block_table: [B_all, W] int32 (unused entries any valid block id); query_start_loc:
        B_all + 1 ints; seq_lens: B_all ints (context length including this step's token)."""
        decode = [b for b in range(len(seq_lens)) if query_start_loc[b + 1] - query_start_loc[b] == 1]
        if not decode:
            return None
        multi = [b for b in range(len(seq_lens)) if query_start_loc[b + 1] - query_start_loc[b] != 1]
        rows = len(decode)
        if rows > self._full.shape[0]:
            self._full = torch.zeros(max(rows, 2 * self._full.shape[0]), self.num_blocks, dtype=torch.int32)
            self._last = torch.zeros_like(self._full)
            self._ones = torch.ones(self._full.shape[0], 1, 1, dtype=torch.int32)
        lens = torch.tensor([seq_lens[b] for b in decode], dtype=torch.int32)
        table = block_table if not multi else block_table.index_select(0, torch.tensor(decode))
        num_full = (lens + self.block_size - 1) // self.block_size - 1
        full, last = self._full[:rows], self._last[:rows]
        full[:, :table.shape[1]] = table
        last[:, :1] = table.gather(1, num_full.long().unsqueeze(1))
        return DecodePlan(
            rows=torch.tensor([query_start_loc[b] for b in decode], dtype=torch.int64),
            full_kv_num=num_full.view(rows, 1, 1),
            last_kv_num=self._ones[:rows],
            full_kv_indices=full.view(rows, 1, 1, -1),
            last_kv_indices=last.view(rows, 1, 1, -1),
            last_len=lens - num_full * self.block_size,
            all_rows=not multi,
            multi=multi)


def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, full_kv_num: torch.Tensor,
            full_kv_indices: torch.Tensor, last_kv_num: torch.Tensor, last_kv_indices: torch.Tensor,
            last_len: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, Hkv, g, D]; caches: [N, bs, Hkv, D]; the rest as in DecodePlan -> [B, Hkv, g, D]
    rows, num_kv_heads, group, head_dim = q.shape
    num_blocks, block_size = key_cache.shape[:2]
    slots = num_blocks * block_size
    k = key_cache.view(1, slots, num_kv_heads, head_dim).transpose(1, 2).expand(rows, -1, -1, -1)
    v = value_cache.view(1, slots, num_kv_heads, head_dim).transpose(1, 2).expand(rows, -1, -1, -1)

    def in_last_block(b, h, q_idx, kv_idx):
        # Applied to the last block only: its slots past the row's length hold nothing yet.
        return kv_idx % block_size < last_len[b]

    mask = BlockMask.from_kv_blocks(last_kv_num, last_kv_indices, full_kv_num, full_kv_indices,
                                    BLOCK_SIZE=(group, block_size), mask_mod=in_last_block,
                                    seq_lengths=(group, slots), compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=mask, scale=scale)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """Around every call of a compiled function of the engine.

    backed_size_oblivious: a size of 1 (one row, one block) is no specialisation of its own, so
    a graph compiles once for every size. Recompiles: each model shape (heads, head size, block
    size, dtype) in a process compiles its own; past the limit dynamo would quietly run eagerly,
    and eager flex_attention over the whole pool is slow. So allow many, and fail loudly past
    that. The patches are built once: each ``config.patch(...)`` call defines a class (~20 us,
    eight calls a step); the objects themselves can be entered again and nest."""
    fx_patch, dynamo_patch = _config_patches()
    with fx_patch, dynamo_patch:
        yield


@functools.cache
def _config_patches():
    return (fx_config.patch(backed_size_oblivious=True),
            torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True))


@functools.cache
def _compiled_decode():
    # Inductor otherwise proves each vector instruction set the CPU reports by compiling a
    # probe program, in every process: measured 20 s of a 34 s cold compile of this kernel,
    # and 11 s of every start with a warm cache. Trust the CPU's flags instead, for the whole
    # process (the probes run outside any config.patch); TORCHINDUCTOR_VEC_ISA_OK=0 keeps them.
    if "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:
        torch._inductor.config.cpp.vec_isa_ok = True
    use_compile_cache()
    # Only the sizes flex_decode marks are dynamic: the row count and the pool's block count, so
    # that one compile serves every batch and every engine's pool (tests start dozens of engines,
    # each with its own pool). Heads, head size and block size stay static: a model's constants.
    # Few symbols also steer clear of a torch 2.13 bug: the CPU template renames its size symbols
    # by plain string replacement, so with many symbols "ks4" also rewrites "ks41".
    return torch.compile(_decode, dynamic=False)


def flex_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
                scale: float) -> torch.Tensor:
    """Attention of the plan's decode rows. query: [T, Hq, D] -> [B, Hq, D] for plan.rows."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    # Contiguous either way: the engine's query is a strided view into the QKV projection, and a
    # stride that differs from the tests' would compile the kernel a second time.
    q = query.contiguous() if plan.all_rows else query.index_select(0, plan.rows)
    rows = q.shape[0]
    q = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    args = (q, key_cache, value_cache, plan.full_kv_num, plan.full_kv_indices, plan.last_kv_num,
            plan.last_kv_indices, plan.last_len)
    for i in (0, 3, 4, 5, 6, 7):  # rows
        torch._dynamo.maybe_mark_dynamic(args[i], 0)
    for tensor, dim in ((key_cache, 0), (value_cache, 0), (args[4], 3), (args[6], 3)):  # pool blocks
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    with compile_settings():
        out = _compiled_decode()(*args, scale)
    return out.view(rows, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    plan: DecodePlan | None) -> torch.Tensor:
    """``reference.paged_attention``'s contract, with the step's decode rows (``plan``) read in
    place by FlexAttention and the rest computed by the twin. Returns [T, Hq, D]."""
    if plan is None:
        return reference.paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                          scale)
    decoded = flex_decode(query, key_cache, value_cache, plan, scale)
    if plan.all_rows:
        return decoded
    out = torch.empty_like(query)
    out.index_copy_(0, plan.rows, decoded)
    reference.multi_token_attention(query, key_cache, value_cache, block_table, query_start_loc.tolist(),
                                    seq_lens.tolist(), scale, plan.multi, out)
    return out
