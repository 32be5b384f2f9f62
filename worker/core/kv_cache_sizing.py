"""How big the KV cache pool is: bytes per token and per block, blocks in a byte budget, and
the engine's refusal when one request of ``max_model_len`` would not fit.

Pure arithmetic (no torch), so the engine at start-up and ``pagefleet plan`` ask the same
functions and cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

# The pool's byte budget per rank on CPU when none is given.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """KV heads one tensor-parallel rank holds: its share, or one replicated head when there
    are fewer KV heads than ranks. Raises ValueError for head counts that do not split."""
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} attention heads do not split over tensor_parallel_size {tp_size}")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split over tensor_parallel_size {tp_size}")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over tensor_parallel_size {tp_size}")
    return max(1, num_kv_heads // tp_size)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token in every layer, for ``kv_heads`` heads (one rank's)."""
    return 2 * num_layers * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    return block_size * kv_bytes_per_token(num_layers, kv_heads, head_dim, dtype_bytes)


def gpu_kv_budget(total_bytes: int, gpu_memory_utilization: float, peak_bytes: int) -> int:
    """The KV bytes a GPU gives: its memory times the utilization fraction, less the peak
    that weights and the largest step's activations reached in the profile run (never < 0)."""
    return max(int(total_bytes * gpu_memory_utilization) - peak_bytes, 0)


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def max_concurrency(self, max_model_len: int) -> float:
        """Requests of ``max_model_len`` tokens the pool holds at once (the engine logs this)."""
        return self.num_tokens / max_model_len


def step_tokens(max_num_batched_tokens: int, num_scheduler_steps: int) -> int:
    """The most tokens one engine step allocates for a sequence: a prompt chunk, or a greedy
    window's decode tokens (``--num-scheduler-steps``)."""
    return max(max_num_batched_tokens, num_scheduler_steps)


def max_tokens_held(max_model_len: int, block_size: int, sliding_window: int | None, step_tokens: int) -> int:
    """Tokens' worth of KV one sequence holds at most: all of ``max_model_len``, or, with a window
    in every layer (the KV manager gives back what leaves it), the window, one step's
    ``step_tokens`` and the block the window starts inside."""
    if sliding_window is None:
        return max_model_len
    return min(max_model_len, sliding_window - 1 + step_tokens + block_size)


def max_blocks_per_seq(max_model_len: int, block_size: int, sliding_window: int | None,
                       step_tokens: int) -> int | None:
    """The blocks one sequence ever holds where every layer slides (``max_tokens_held``); None
    without such a window (a sequence then holds every block it grows to)."""
    if sliding_window is None:
        return None
    return -(-max_tokens_held(max_model_len, block_size, sliding_window, step_tokens) // block_size)


def size_kv_pool(budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                 tokens_held: int | None = None) -> KVPoolSize:
    """Whole blocks in the budget. Raises ValueError, as the engine does at start-up, when not one
    block fits or when one request of ``max_model_len`` would not fit (``tokens_held``: what such a
    request holds at once, ``max_tokens_held``; all of it by default): every long request would
    fail later instead (vLLM refuses the same way)."""
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; "
                         "raise kv_cache_bytes / gpu_memory_utilization")
    pool = KVPoolSize(num_blocks, block_size, bytes_per_block)
    held = max_model_len if tokens_held is None else tokens_held
    if pool.num_tokens < -(-held // block_size) * block_size:
        what = f"max_model_len {max_model_len}" if held == max_model_len else (
            f"a sliding-window request of max_model_len {max_model_len} (holding up to {held} tokens)")
        raise ValueError(
            f"{what} is larger than the {pool.num_tokens} tokens the KV cache "
            f"holds ({num_blocks} blocks of {block_size}); lower max_model_len or raise "
            "kv_cache_bytes / gpu_memory_utilization")
    return pool
