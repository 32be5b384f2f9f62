"""Engine options, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None  # local checkpoint dir; None -> the built-in demo checkpoint (random weights)
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None  # the KV pool's byte budget per TP rank (CPU default 512 MiB)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    load_format: str = "safetensors"  # or "dummy": random weights from config.json alone

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
