"""Paged attention through PyTorch's FlexAttention, reading the KV blocks where they lie.

A layer's whole KV pool goes to ``flex_attention`` as one long key sequence of
N * bs slots (``[1, Hkv, N*bs, D]``, a view, no copy), and the block table becomes
flex's sparse block index: each query row visits exactly the physical blocks of
its table, ``bs`` slots at a time. Blocks wholly before a query block's first
position are "full" (no mask); the rest are masked by causality, with each
slot's logical position taken from ``block_pos``, the index of its physical
block within the tables that hold it. That index is the same in every table
sharing the block: prefix blocks are shared only at the position they were
hashed at.

Decode rows (one new token) run as one batch ``[B, Hq, 1, D]``. Rows that
continue a context already in the cache (prefill chunks, prompts after a prefix
hit) run as padded batches ``[B, Hq, L, D]``, L rounded up to a bucket (16, 64,
256, ... up to the step's token budget); query blocks past a row's end visit no
KV block, so padding costs a copy, not attention. Each bucket compiles once
(Inductor's C++ flash-attention template on CPU), with the row count B its only
dynamic size. A fresh prompt (no context
before its new tokens) reads nothing from the cache: it attends over its own
keys and values with causal SDPA. The twin is ``reference.paged_attention``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Query rows per sparse query block of a prefill batch. Smaller blocks skip more of the
# causal triangle; larger ones give the C++ template bigger matmuls.
PREFILL_Q_BLOCK = 32
# Padded query lengths of prefill batches: each is one compiled kernel.
FIRST_BUCKET, BUCKET_GROWTH = 16, 4


def query_buckets(max_q_len: int) -> list[int]:
    """Every padded query length a step of at most max_q_len tokens can use (decode's 1 first)."""
    buckets = [1]
    while buckets[-1] < max_q_len:
        buckets.append(min(max(FIRST_BUCKET, buckets[-1] * BUCKET_GROWTH), max_q_len))
    return buckets


def query_bucket(q_len: int, max_q_len: int) -> int:
    """The padded query length a row with q_len new tokens is batched under."""
    return next(b for b in query_buckets(max(max_q_len, q_len)) if b >= q_len)


@dataclass(slots=True)
class FlexPart:
    """The rows of one query bucket, as flex_attention sees them."""

    token_rows: torch.Tensor       # [n] int64: the rows' tokens among the step's T
    padded_rows: torch.Tensor      # [n] int64: where each lands in the [B * L] padded query batch
    q_start: torch.Tensor          # [B] int32: logical position of each row's first new token
    kv_num: torch.Tensor           # [B, 1, Q] int32: masked KV blocks per query block
    kv_indices: torch.Tensor       # [B, 1, Q, N] int32: their physical ids (first kv_num valid)
    full_kv_num: torch.Tensor      # [B, 1, Q] int32: KV blocks wholly before the query block
    full_kv_indices: torch.Tensor  # [B, 1, Q, N] int32
    num_rows: int                  # B
    q_len: int                     # L, the bucket
    q_block: int                   # query rows per sparse block (Q = L / q_block)


@dataclass(slots=True)
class FlexPlan:
    """One step's attention layout, built once on the host and shared by every layer."""

    block_pos: torch.Tensor   # [N] int32: index of each physical block within its tables
    parts: list[FlexPart]     # one per query bucket present in the step
    fresh: list[tuple[int, int]]  # (first token, end) of each row whose context is only its new tokens


def _part(rows: list[int], starts: list[int], lens: list[int], table: torch.Tensor, block_size: int,
          q_len: int, num_blocks: int) -> FlexPart:
    # table: [B_all, M] int32 on the host, the whole step's block table
    q_block = min(PREFILL_Q_BLOCK, q_len)
    num_q_blocks = q_len // q_block
    q_lens = torch.tensor([starts[b + 1] - starts[b] for b in rows], dtype=torch.int32)
    q_start = torch.tensor([lens[b] for b in rows], dtype=torch.int32) - q_lens
    # First and last position of each query block; a block past the row's end is empty.
    first = q_start[:, None] + torch.arange(num_q_blocks, dtype=torch.int32) * q_block        # [B, Q]
    last = q_start[:, None] + torch.minimum(first - q_start[:, None] + q_block, q_lens[:, None]) - 1
    live = first <= q_start[:, None] + q_lens[:, None] - 1
    num_full = torch.where(live, (first + 1) // block_size, 0)
    num_needed = torch.where(live, last // block_size + 1, 0)
    sub = table.index_select(0, torch.tensor(rows))                                            # [B, M]
    width = sub.shape[1]
    # Masked blocks of query block q are table[num_full : num_needed]: shift them to the front.
    shift = (num_full[:, :, None] + torch.arange(width, dtype=torch.int32)).clamp_(max=width - 1)
    masked = sub[:, None, :].expand(-1, num_q_blocks, -1).gather(2, shift.long())
    full = sub[:, None, :].expand(-1, num_q_blocks, -1)

    def indices(x: torch.Tensor) -> torch.Tensor:
        # flex_attention wants an index row as wide as the key sequence has blocks (the pool).
        return torch.nn.functional.pad(x, (0, num_blocks - width)).unsqueeze(1).contiguous()

    token_rows = [t for b in rows for t in range(starts[b], starts[b + 1])]
    padded = [i * q_len + j for i, b in enumerate(rows) for j in range(starts[b + 1] - starts[b])]
    return FlexPart(
        token_rows=torch.tensor(token_rows, dtype=torch.int64), padded_rows=torch.tensor(padded, dtype=torch.int64),
        q_start=q_start, kv_num=(num_needed - num_full).unsqueeze(1).contiguous(), kv_indices=indices(masked),
        full_kv_num=num_full.unsqueeze(1).contiguous(), full_kv_indices=indices(full),
        num_rows=len(rows), q_len=q_len, q_block=q_block)


def build_plan(block_table: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], block_size: int,
               block_pos: torch.Tensor, max_q_len: int) -> FlexPlan:
    """Host-side layout of one step (CPU tensors).

    block_table: [B, M] int32 (rows padded with any valid block id); query_start_loc: B + 1
    ints; seq_lens: B ints (context length including this step's tokens); block_pos: [N] int32,
    updated in place with the index of every block in the step's tables; max_q_len: the most
    new tokens a row can have (the engine's max_num_batched_tokens), the largest bucket.
    """
    width = block_table.shape[1]
    valid = torch.arange(width) < torch.tensor([-(-n // block_size) for n in seq_lens])[:, None]  # [B, M]
    block_pos.index_put_((block_table[valid].long(),), torch.arange(width, dtype=torch.int32).expand_as(valid)[valid])
    buckets: dict[int, list[int]] = {}
    fresh: list[tuple[int, int]] = []
    for b, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if end - start == seq_len > 1:
            fresh.append((start, end))
        else:
            buckets.setdefault(query_bucket(end - start, max_q_len), []).append(b)
    parts = [_part(rows, query_start_loc, seq_lens, block_table, block_size, q_len, len(block_pos))
             for q_len, rows in sorted(buckets.items())]
    return FlexPlan(block_pos, parts, fresh)


def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_pos: torch.Tensor,
            q_start: torch.Tensor, kv_num: torch.Tensor, kv_indices: torch.Tensor, full_kv_num: torch.Tensor,
            full_kv_indices: torch.Tensor, q_block: int, scale: float) -> torch.Tensor:
    # q: [B, Hq, L, D]; caches: [N, bs, Hkv, D]; the rest as in FlexPart -> [B, Hq, L, D]
    rows, num_heads, length, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    slots = num_blocks * block_size
    k = key_cache.view(1, slots, num_kv_heads, head_dim).transpose(1, 2).expand(rows, -1, -1, -1)
    v = value_cache.view(1, slots, num_kv_heads, head_dim).transpose(1, 2).expand(rows, -1, -1, -1)

    def causal_over_pages(b, h, q_idx, kv_idx):
        # kv_idx is a physical slot; its logical position is block index * bs + offset.
        return block_pos[kv_idx // block_size] * block_size + kv_idx % block_size <= q_start[b] + q_idx

    mask = BlockMask.from_kv_blocks(kv_num, kv_indices, full_kv_num, full_kv_indices,
                                    BLOCK_SIZE=(q_block, block_size), mask_mod=causal_over_pages,
                                    seq_lengths=(length, slots), compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """Around every call of a compiled function here and in the compiled step.

    backed_size_oblivious: a size of 1 (one token, one row) is no specialisation of its own,
    so each graph compiles once for every size. Recompiles: every engine in a process (tests
    start dozens) adds its own pool size and model to the compiled functions' caches; past
    the limit dynamo would quietly run them eagerly, and eager flex_attention is both slow
    and, with this paged block mask, wrong. So allow many, and fail loudly past that."""
    with fx_config.patch(backed_size_oblivious=True), \
            torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield


@functools.cache
def _compiled_attend():
    # Eager flex_attention materialises the dense score matrix; compiled, it is one fused
    # kernel. Only the row count B is dynamic (marked per call). Keeping every other size
    # static also steers clear of a torch 2.13 bug: the CPU template renames its split-size
    # symbols by plain string replacement, so with many size symbols "ks4" also rewrites "ks41".
    return torch.compile(_attend, dynamic=False)


def _run_part(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, part: FlexPart,
              block_pos: torch.Tensor, scale: float) -> torch.Tensor:
    # query: [T, Hq, D]; caches: [N, bs, Hkv, D] -> [n, Hq, D] for part.token_rows
    rows, length = part.num_rows, part.q_len
    q = query.index_select(0, part.token_rows)
    if length > 1:
        q = q.new_zeros(rows * length, *q.shape[1:]).index_copy_(0, part.padded_rows, q)
    q = q.view(rows, length, *q.shape[1:]).transpose(1, 2).contiguous()                       # [B, Hq, L, D]
    args = (q, key_cache, value_cache, block_pos, part.q_start, part.kv_num, part.kv_indices, part.full_kv_num,
            part.full_kv_indices)
    for i in (0, 4, 5, 6, 7, 8):
        torch._dynamo.maybe_mark_dynamic(args[i], 0)
    with compile_settings():
        o = _compiled_attend()(*args, part.q_block, scale)
    o = o.transpose(1, 2).reshape(rows * length, *o.shape[1:2], o.shape[-1])                   # [B * L, Hq, D]
    return o if length == 1 else o.index_select(0, part.padded_rows)


def flex_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, plan: FlexPlan, scale: float) -> torch.Tensor:
    """Causal attention of each row's new tokens over its paged context (same contract as
    ``reference.paged_attention``, with the block table already turned into ``plan``).

    query: [T, Hq, D]; key, value: [T, Hkv, D], this step's (already written to the caches);
    key_cache, value_cache: [N, bs, Hkv, D]. Returns [T, Hq, D].
    """
    out = torch.empty_like(query)
    gqa = query.shape[1] != key.shape[1]
    for start, end in plan.fresh:
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))                # [H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    for part in plan.parts:
        out.index_copy_(0, part.token_rows, _run_part(query, key_cache, value_cache, part, plan.block_pos, scale))
    return out
