"""The one place that decides which implementation of each kernel runs.

Until the Triton kernels land, every op is its PyTorch twin.
"""

from pagefleet.kernels.reference import (  # noqa: F401
    build_cos_sin_cache,
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)
