"""The CPU engine's small per-layer ops in one C++ pass each: residual add + RMSNorm, the
rotary embedding (in place), and the one-row linear (worker/cpu/linear.py times it at load
against oneDNN and F.linear, and keeps the fastest).

As PyTorch ops each of the norms and the rotary is 6-12 kernel launches over a few kilobytes,
which at one decode row costs more than the arithmetic (figures in docs/cpu_engine.md). Here
each is one call into C++ built by ``cpu_build``, rows spread over torch's threads from 64
rows on. fp32 with the layouts the engine passes (rows of contiguous features; q and k views
into the fused QKV projection); anything else goes to the twins in ``reference.py``, which
these follow formula for formula (sums vectorised, so the last bit can differ).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from pagefleet.kernels import reference
from pagefleet.kernels.cpu import build as cpu_build
from pagefleet.kernels.ops import Kernels

_SOURCE = r"""
#include <cmath>
#include <cstdint>

extern "C" {
// One-row linear: y[o] = w[o, :] . x (+ bias[o]); w: [out, in] row-major; outputs spread over the
// threads. Streams the weight once, at memory speed.
void gemv(const float* w, const float* x, const float* bias, float* y, int64_t out, int64_t in, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t o = 0; o < out; ++o) {
    const float* row = w + o * in;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) sum += row[i] * x[i];
    y[o] = bias ? sum + bias[o] : sum;
  }
}

// x: [rows, h] (row stride x_stride); residual likewise or null; out, new_residual: [rows, h]
// contiguous. new_residual = x + residual; out = rms_norm(new_residual or x) * weight.
void add_rms_norm(const float* x, int64_t x_stride, const float* residual, int64_t r_stride, const float* weight,
                  float* out, float* new_residual, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for if (rows >= 64)
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = x + i * x_stride;
    float sum = 0.f;
    if (residual) {
      const float* res = residual + i * r_stride;
      float* dst = new_residual + i * h;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < h; ++j) {
        const float v = src[j] + res[j];
        dst[j] = v;
        sum += v * v;
      }
      src = dst;
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < h; ++j) sum += src[j] * src[j];
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
    float* o = out + i * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) o[j] = (src[j] * inv) * weight[j];
  }
}

// Neox-style rotary embedding in place. x: [rows, heads, d] with row stride x_stride and heads
// d apart; cos_sin: [max_position, d], cos in the first d/2 columns, sin in the rest.
void rotary(const int64_t* positions, float* x, int64_t x_stride, int64_t heads, int64_t d, const float* cos_sin,
            int64_t rows) {
  const int64_t half = d / 2;
#pragma omp parallel for if (rows >= 64)
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos_sin + positions[t] * d;
    const float* s = c + half;
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* p = x + t * x_stride + hd * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = p[j], x2 = p[j + half];
        p[j] = x1 * c[j] - x2 * s[j];
        p[j + half] = x2 * c[j] + x1 * s[j];
      }
    }
  }
}
}
"""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_build.load_library("fused_ops", _SOURCE)
    lib.add_rms_norm.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _F]
    lib.rotary.argtypes = [_P, _P, _I, _I, _I, _P, _I]
    lib.gemv.argtypes = [_P, _P, _P, _P, _I, _I, _I]
    return lib


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One-row linear. x: [1, in]; weight: [out, in] contiguous; bias: [out] or None; all fp32 -> [1, out]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(1, weight.shape[0], dtype=weight.dtype)
    _library().gemv(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                    weight.shape[0], weight.shape[1], torch.get_num_threads())
    return y


def _rows(x: torch.Tensor) -> bool:
    """fp32 rows of contiguous features: [rows, h] with stride(1) == 1."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not (_rows(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    _library().add_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), None,
                            x.shape[0], x.shape[1], eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_rows(x) and _rows(residual) and x.shape == residual.shape and weight.dtype == torch.float32
            and weight.is_contiguous()):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, new_residual = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _library().add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                            out.data_ptr(), new_residual.data_ptr(), x.shape[0], x.shape[1], eps)
    return out, new_residual


def _heads(x: torch.Tensor) -> bool:
    """fp32 [rows, heads, d] with each head's d contiguous and heads d apart."""
    return x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_heads(query) and _heads(key) and positions.dtype == torch.int64 and positions.is_contiguous()
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    lib = _library()
    for x in (query, key):
        lib.rotary(positions.data_ptr(), x.data_ptr(), x.stride(0), x.shape[1], x.shape[2], cos_sin_cache.data_ptr(),
                   x.shape[0])
    return query, key


def with_fused_ops(kernels: Kernels) -> Kernels:
    """``kernels`` (the PyTorch twins) with these ops in place of the twins' norm and rotary;
    builds the library now rather than on the first request."""
    _library()
    return dataclasses.replace(kernels, rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm,
                               rotary_embedding=rotary_embedding)
