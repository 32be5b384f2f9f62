"""One Triton kernel body that runs compiled on CUDA tensors and interpreted on CPU tensors.

`triton.jit` decides once, at import, from TRITON_INTERPRET. pagefleet decides
per call from the tensors' device instead, so `PAGEFLEET_KERNELS=triton` on a
CPU-only machine runs the interpreter whatever the import order was, and a CUDA
tensor never meets the interpreter by accident. With TRITON_INTERPRET=1 set at
import, both variants are interpreted (Triton's own meaning of that switch).

Kernel bodies must not call `@triton.jit` helpers: a compiled body may only
call JITFunctions and an interpreted one only InterpretedFunctions. Helpers are
therefore written inline, and reductions are spelled `tl.reduce(x, axis, SUM)`
instead of `tl.sum(x, axis)` (tl.sum is a JITFunction; tl.reduce is a builtin
that the interpreter maps onto numpy for exactly these combiners, and that
compiles to the same code as tl.sum / tl.max).
"""

from __future__ import annotations

import inspect
import os
import re

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# The combiners tl.sum / tl.max pass to tl.reduce; the interpreter recognises them by identity.
SUM = tl.standard._sum_combine
MAX = tl.standard._elementwise_max


def _interpret_everything() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _jit_library_calls(fn) -> list[str]:
    # `tl.zeros`, `tl.sum`, `tl.cdiv`, ... are themselves JITFunctions, which only a
    # compiled body can call; catch them when the kernel is defined, not mid-test.
    names = set(re.findall(r"\btl\.(\w+)", inspect.getsource(fn)))
    return sorted(n for n in names if isinstance(getattr(tl, n, None), JITFunction))


class TritonKernel:
    """A kernel body with a compiled (CUDA) and an interpreted (CPU) variant, built on first use."""

    def __init__(self, fn, do_not_specialize: tuple[str, ...] = ()):
        bad = _jit_library_calls(fn)
        if bad:
            raise TypeError(f"{fn.__name__} calls Triton library functions that are JITFunctions "
                            f"({', '.join('tl.' + n for n in bad)}), which the CPU interpreter cannot run "
                            f"from a kernel: use tl.full / tl.reduce(x, axis, SUM|MAX) / integer arithmetic")
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled: JITFunction | None = None
        self._interpreted: InterpretedFunction | None = None

    @property
    def __name__(self) -> str:
        return self.fn.__name__

    def compiled(self) -> JITFunction:
        # The GPU variant; also what the ahead-of-time compile check feeds to triton.compile.
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, do_not_specialize=list(self.do_not_specialize))
        return self._compiled

    def interpreted(self) -> InterpretedFunction:
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def on(self, device: torch.device):
        """The variant to launch for tensors on `device`: `kernel.on(x.device)[grid](...)`."""
        if device.type == "cpu" or _interpret_everything():
            return self.interpreted()
        if device.type == "cuda":
            return self.compiled()
        raise ValueError(f"Triton kernels run on cuda (compiled) or cpu (interpreted), not {device.type}")


def triton_kernel(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """Decorator used instead of `@triton.jit` for every pagefleet kernel.

    `do_not_specialize` names integer arguments that change from step to step
    (batch size, block-table width): Triton would otherwise compile a new
    variant whenever one of them becomes 1 or a multiple of 16, mid-serving.
    """
    if fn is None:
        return lambda f: TritonKernel(f, do_not_specialize)
    return TritonKernel(fn, do_not_specialize)


def interpreted(device: torch.device) -> bool:
    """True when kernels for `device` run under the interpreter (feeds the UPCAST constexpr).

    The interpreter computes on numpy: bf16 is stored as uint16 there, so bf16
    arithmetic and bf16 `tl.dot` are wrong unless operands are upcast to fp32
    right after `tl.load`.
    """
    return device.type != "cuda" or _interpret_everything()


def next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is a constexpr function with call overhead on every launch.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels address the last dimension as `base + offs`; other strides are passed in.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return first


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    # The stored value is x / scale: a zero, negative or non-finite scale makes the cache garbage.
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < float("inf"):
            raise ValueError(f"{name} must be a finite positive float, got {value!r}")
