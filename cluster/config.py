"""The options of ``pagefleet serve`` and of the Serve app builder, in one place.

The CLI flags, the ``args:`` of ``deploy/serve.yaml`` and ``build_app``'s
dict all map onto ``ServeOptions``; names follow vLLM's flags (with
underscores) where vLLM has one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from pagefleet.worker.engine_args import EngineArgs

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """``536870912``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` -> bytes (KiB/MiB/GiB binary, K/KB/M/MB/G/GB decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        result = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise ValueError(f"not a byte size: {value!r} (use e.g. 536870912, 512MiB, 2GiB)")
        result = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if result <= 0:
        raise ValueError(f"a byte size must be > 0, got {value!r}")
    return result


@dataclass(slots=True)
class ServeOptions:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    load_format: str = "safetensors"
    seed: int = 0
    api_key: str | None = None
    # Ray resources. None: one GPU per TP rank when the cluster has GPUs, else none.
    worker_num_cpus: float = 1.0
    worker_num_gpus: float | None = None
    ingress_num_cpus: float = 0.5
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        if self.kv_cache_bytes is not None:
            self.kv_cache_bytes = parse_bytes(self.kv_cache_bytes)
        if self.kv_cache_bytes is not None and self.gpu_memory_utilization is not None:
            raise ValueError("give kv_cache_bytes or gpu_memory_utilization, not both")
        for name in ("workers", "ingress_replicas", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.worker_num_cpus < 0 or self.ingress_num_cpus < 0:
            raise ValueError("CPU counts must be >= 0")
        self.engine_args()  # the engine's own checks, now rather than inside a replica

    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> "ServeOptions":
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown serve option(s) {unknown}; known: {sorted(known)}")
        return cls(**args)

    def engine_args(self) -> EngineArgs:
        extra = {} if self.gpu_memory_utilization is None else {"gpu_memory_utilization": self.gpu_memory_utilization}
        return EngineArgs(
            model=self.model, served_model_name=self.served_model_name, dtype=self.dtype, device=self.device,
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache_bytes, enable_prefix_caching=self.enable_prefix_caching,
            tensor_parallel_size=self.tensor_parallel_size, seed=self.seed, load_format=self.load_format, **extra)

    def logical_cpus_needed(self) -> float:
        """CPUs the app reserves on a Ray cluster (Serve's controller and proxy take none)."""
        return self.workers * self.tensor_parallel_size * self.worker_num_cpus + \
            self.ingress_replicas * self.ingress_num_cpus
