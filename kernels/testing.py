"""Random inputs for comparing the Triton kernels with their twins (tests and benchmarks/gpu_check.py).

Nothing here runs in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Arguments of `paged_attention` for one engine step."""

    query: torch.Tensor            # [T, Hq, D]
    key_cache: torch.Tensor        # [N, bs, Hkv, D]
    value_cache: torch.Tensor      # [N, bs, Hkv, D]
    block_table: torch.Tensor      # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.query_start_loc,
                self.seq_lens)


def make_paged_batch(seqs: list[tuple[int, int]], *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                     shared_prefix_blocks: int = 0, extra_blocks: int = 3, table_width: int | None = None,
                     seed: int = 0) -> PagedBatch:
    """One step's batch: `seqs` lists (q_len, seq_len) per sequence.

    q_len == 1 is decode, q_len == seq_len a fresh prefill, anything between a
    prefill chunk or a prompt after a prefix-cache hit. Physical blocks are a
    random permutation (so tables are not the identity), with `extra_blocks`
    unused blocks in the pool. With `shared_prefix_blocks` = k, every sequence's
    first k table entries are the same physical blocks, as after prefix-cache
    hits on a common prompt prefix. Unused table entries hold block 0.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for _, seq_len in seqs]
    if any(q_len < 1 or q_len > seq_len for q_len, seq_len in seqs):
        raise ValueError(f"each sequence needs 1 <= q_len <= seq_len, got {seqs}")
    if shared_prefix_blocks and min(blocks_needed) < shared_prefix_blocks:
        raise ValueError("every sequence must cover the shared prefix")
    own = [n - shared_prefix_blocks for n in blocks_needed]
    num_blocks = shared_prefix_blocks + sum(own) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = table_width or max(blocks_needed)
    block_table = torch.zeros(len(seqs), width, dtype=torch.int32)
    shared, next_free = perm[:shared_prefix_blocks], shared_prefix_blocks
    for b, n in enumerate(own):
        block_table[b, :shared_prefix_blocks] = shared
        block_table[b, shared_prefix_blocks:shared_prefix_blocks + n] = perm[next_free:next_free + n]
        next_free += n
    q_lens = torch.tensor([q for q, _ in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        query=torch.randn(int(q_lens.sum()), num_q_heads, head_dim, generator=gen).to(device, dtype),
        key_cache=torch.randn(shape, generator=gen).to(device, dtype),
        value_cache=torch.randn(shape, generator=gen).to(device, dtype),
        block_table=block_table.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
    )


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0


def forget_loaded_cpu_kernels() -> None:
    """As in a new process: no C++ kernel library loaded, so the next use finds it in the kernel
    cache on disk or builds it (tests count the builds)."""
    from pagefleet.kernels.cpu import build as cpu_build, fused_ops as cpu_fused_ops

    cpu_build.load_library.cache_clear()
    cpu_fused_ops._library.cache_clear()
