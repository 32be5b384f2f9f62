"""Paged decode attention on CPU: a C++ kernel that reads each row's KV blocks where they lie.

Decode rows (one new token each) are most of a busy step's attention and all of a single
stream's, and they are memory-bound: each reads its whole context's K and V once. The twin
(``reference.paged_attention``) first gathers every context into a contiguous copy; this
kernel reads the blocks in place instead (figures in docs/cpu_engine.md).

The kernel is plain C++ with OpenMP, built once per model shape by ``cpu_build`` and called
through ctypes. One row is one work item (rows spread over the engine's threads): for each
block of its table it reads the block's K (all KV heads: one contiguous
``block_size x Hkv x D`` span), scores every query head, folds the block into an online
softmax, then reads the block's V. Head size, GQA group, KV heads and block size are
compile-time constants. fp32, bf16 and fp16 caches; scores, softmax and sums in fp32.

Rows with several new tokens (prompts, prefill chunks) attend over their own context in
the twin, where the gather is small next to the attention work.

As a kernel-table entry (kernels/cpu/backend.py): ``decode_attention_planner`` builds the
kernel for the model's shape and plans each step's decode rows (``plan_decode``), and
``paged_attention`` consumes that plan.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.kernels.ops import AttentionPlanner, AttentionSpec

# The entry point of each cache dtype (ENTRY below).
ENTRIES = {torch.float32: "decode_f32", torch.bfloat16: "decode_bf16", torch.float16: "decode_f16"}

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
constexpr int64_t D = @HEAD_DIM@, G = @GROUP@, HKV = @KV_HEADS@, BS = @BLOCK_SIZE@;
constexpr int64_t HQ = HKV * G, KV_ROW = HKV * D;  // query heads; elements from one token to the next

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(uint16_t x) {  // bfloat16: the high half of an fp32
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(_Float16* p, float x) { *p = static_cast<_Float16>(x); }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch converts
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  *p = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// q: rows of HQ x D (q_stride elements apart); caches: [num_blocks, BS, HKV, D]; block_table:
// [rows, width]; seq_lens: [rows]; out: [rows, HQ, D]. Row b attends over its first
// seq_lens[b] tokens, or with window > 0 over the last `window` of them only (blocks before
// those are never read: the KV manager may have freed them). sinks: [HQ] fp32 or null: each
// head's attention-sink logit joins the softmax's denominator (gpt-oss).
template <typename T>
void decode(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int32_t* block_table,
            int64_t width, const int32_t* seq_lens, T* out, int64_t rows, float scale, int64_t window,
            const float* sinks, int64_t threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < rows; ++b) {
    float qf[HQ][D], acc[HQ][D], m[HQ], l[HQ], s[HQ][BS];
    for (int64_t r = 0; r < HQ; ++r) {
      for (int64_t d = 0; d < D; ++d) {
        qf[r][d] = to_float(q[b * q_stride + r * D + d]);
        acc[r][d] = 0.f;
      }
      m[r] = 0.f;
      l[r] = 0.f;
    }
    const int64_t len = seq_lens[b];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // first visible token
    for (int64_t blk = lo / BS; blk * BS < len; ++blk) {
      const bool first = blk == lo / BS;
      const int64_t t0 = first ? lo - blk * BS : 0;  // the first visible token in this block
      const int64_t n = std::min(BS, len - blk * BS);
      const int64_t base = static_cast<int64_t>(block_table[b * width + blk]) * BS * KV_ROW;
      const T* kb = k_cache + base;
      const T* vb = v_cache + base;
      for (int64_t t = t0; t < n; ++t) {
        for (int64_t r = 0; r < HQ; ++r) {
          const T* k = kb + t * KV_ROW + (r / G) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qf[r][d] * to_float(k[d]);
          s[r][t] = dot * scale;
        }
      }
      for (int64_t r = 0; r < HQ; ++r) {  // online softmax: fold this block in
        float mx = first ? s[r][t0] : m[r];
        for (int64_t t = t0; t < n; ++t) mx = std::max(mx, s[r][t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = t0; t < n; ++t) {
          s[r][t] = std::exp(s[r][t] - mx);
          sum += s[r][t];
        }
        if (!first) {
          const float corr = std::exp(m[r] - mx);
          l[r] = l[r] * corr + sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[r][d] *= corr;
        } else {
          l[r] = sum;
        }
        m[r] = mx;
      }
      for (int64_t t = t0; t < n; ++t) {
        for (int64_t r = 0; r < HQ; ++r) {
          const T* v = vb + t * KV_ROW + (r / G) * D;
          const float p = s[r][t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[r][d] += p * to_float(v[d]);
        }
      }
    }
    if (sinks != nullptr) {
      for (int64_t r = 0; r < HQ; ++r) {  // the sink as one more logit with no value
        const float mx = std::max(m[r], sinks[r]);
        const float corr = std::exp(m[r] - mx);
        l[r] = l[r] * corr + std::exp(sinks[r] - mx);
        for (int64_t d = 0; d < D; ++d) acc[r][d] *= corr;
      }
    }
    for (int64_t r = 0; r < HQ; ++r) {
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t d = 0; d < D; ++d) store(out + (b * HQ + r) * D + d, acc[r][d] * inv);
    }
  }
}
}  // namespace

#define ENTRY(name, T)                                                                                  \
  extern "C" void name(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,              \
                       const int32_t* block_table, int64_t width, const int32_t* seq_lens, T* out,     \
                       int64_t rows, float scale, int64_t window, const float* sinks, int64_t threads) {  \
    decode<T>(q, q_stride, k_cache, v_cache, block_table, width, seq_lens, out, rows, scale, window,   \
              sinks, threads);                                                                          \
  }
ENTRY(decode_f32, float)
ENTRY(decode_bf16, uint16_t)
ENTRY(decode_f16, _Float16)
"""

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64]


def decode_kernel(dtype: torch.dtype, head_dim: int, group: int, num_kv_heads: int,
                  block_size: int) -> Callable[..., None]:
    """The kernel entry point for one model shape and cache dtype (the library from cpu_build:
    its cache, else compiled into it). Resolved once per engine, when its KV cache is allocated
    (``decode_attention_planner``); each step's plan carries it to every layer."""
    source = (_SOURCE.replace("@HEAD_DIM@", str(head_dim)).replace("@GROUP@", str(group))
              .replace("@KV_HEADS@", str(num_kv_heads)).replace("@BLOCK_SIZE@", str(block_size)))
    fn = getattr(cpu_build.load_library("decode_attention", source), ENTRIES[dtype])
    fn.argtypes = _ARGTYPES
    return fn


@dataclass(slots=True)
class DecodePlan:
    """One step's decode rows, built once on the host before the forward pass and shared by
    every layer."""

    kernel: Callable[..., None]  # decode_kernel() of the model's shape and dtype
    rows: torch.Tensor | None  # [B] int64: the decode rows' tokens among the step's T; None: all of them
    block_table: torch.Tensor  # [B, W] int32, contiguous: the decode rows' tables
    seq_lens: torch.Tensor     # [B] int32: their context lengths (this step's token included)
    multi: list[int]           # sequences with more than one new token: the twin serves them
    starts: list[int]          # the step's query_start_loc and context lengths, for the twin's rows
    lens: list[int]


def plan_decode(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: list[int], lens: list[int],
                kernel: Callable[..., None]) -> DecodePlan | None:
    """The step's decode rows, or None if it has none. block_table: [B_all, W] int32; seq_lens:
    [B_all] int32; query_start_loc: B_all + 1 ints; lens: seq_lens as the step's list (the twin's
    rows read it); kernel: decode_kernel()."""
    q_lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(query_start_loc) - 1)]
    multi = [b for b, n in enumerate(q_lens) if n != 1]
    if not multi:
        return DecodePlan(kernel, None, block_table.contiguous(), seq_lens.contiguous(), [], query_start_loc, [])
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if not decode:
        return None
    index = torch.tensor(decode)
    return DecodePlan(kernel, torch.tensor([query_start_loc[b] for b in decode]), block_table.index_select(0, index),
                      seq_lens.index_select(0, index), multi, query_start_loc, lens)


def decode_attention_planner(spec: AttentionSpec) -> AttentionPlanner:
    """The step planner of an engine with this attention shape: ``plan_decode`` with the kernel
    built (or taken from the kernel cache) now, at start, rather than on the first request."""
    kernel = decode_kernel(spec.dtype, spec.head_dim, spec.num_heads // spec.num_kv_heads, spec.num_kv_heads,
                           spec.block_size)
    return functools.partial(plan_decode, kernel=kernel)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
                     scale: float, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the plan's decode rows. query: [T, Hq, D] -> [B, Hq, D] for plan.rows; with
    ``sliding_window`` W each row sees its last W tokens only; ``sinks`` [Hq]: gpt-oss's
    per-head sink logits."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
    num_heads, head_dim = query.shape[1:]
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the CPU decode attention reads contiguous [num_blocks, block_size, Hkv, D] caches")
    q = query if plan.rows is None else query.index_select(0, plan.rows)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    rows = q.shape[0]
    out = torch.empty(rows, num_heads, head_dim, dtype=query.dtype)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    plan.kernel(q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), plan.block_table.data_ptr(),
       plan.block_table.shape[1], plan.seq_lens.data_ptr(), out.data_ptr(), rows, scale, sliding_window or 0,
       None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    *, k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, plan: DecodePlan | None = None) -> torch.Tensor:
    """``reference.paged_attention``'s contract, with the step's decode rows (``plan``) read in
    place by the kernel and the rest computed by the twin. Returns [T, Hq, D]. The caches hold
    the query's dtype (an fp8 cache keeps the twin: ``compiled_cpu_kernels``), so the scales,
    which only fp8 caches read, go unused."""
    if key_cache.dtype != query.dtype:
        raise ValueError(f"the CPU decode attention reads caches of the query's dtype {query.dtype}, "
                         f"got {key_cache.dtype}")
    if plan is None:
        return reference.paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                          scale, sliding_window=sliding_window, sinks=sinks)
    decoded = decode_attention(query, key_cache, value_cache, plan, scale, sliding_window, sinks)
    if plan.rows is None:
        return decoded
    out = torch.empty_like(query)
    out.index_copy_(0, plan.rows, decoded)
    reference.multi_token_attention(query, key_cache, value_cache, block_table, plan.starts, plan.lens, scale,
                                    plan.multi, out, sliding_window, sinks)
    return out
