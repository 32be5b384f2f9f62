"""Triton KV cache write against its twin (CPU interpreter): a bit copy, so results must be equal."""

import pytest
import torch

pytest.importorskip("triton")

from pagefleet.kernels import reference  # noqa: E402
from pagefleet.kernels.kv_cache_write import write_kv_cache  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (3, 1, 128), (5, 3, 40)])
def test_write_kv_cache_matches_twin_and_skips_padding(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_q_heads = 9, 2
    # K and V are views into a fused QKV output: strided rows, as the engine passes them.
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(7, width, generator=gen).to(dtype)
    k = qkv[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim].view(7, num_kv_heads, head_dim)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(7, num_kv_heads, head_dim)
    last = num_blocks * block_size - 1
    slots = torch.tensor([3, -1, 0, last, block_size + 1, -1, 2 * block_size])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, 7.0, dtype=dtype)
    value_cache = torch.full(shape, -7.0, dtype=dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()

    write_kv_cache(k, v, key_cache, value_cache, slots)
    reference.write_kv_cache(k, v, expected_key, expected_value, slots)

    assert torch.equal(key_cache, expected_key) and torch.equal(value_cache, expected_value)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[last], k[3])
    # Only the five real slots changed.
    changed = (flat_k != 7.0).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == sorted([3, 0, last, block_size + 1, 2 * block_size])


def test_write_kv_cache_rejects_mismatches():
    k = torch.randn(2, 1, 32)
    cache = torch.zeros(4, 2, 1, 32)
    with pytest.raises(ValueError, match="dtypes"):
        write_kv_cache(k, k, cache.half(), cache.half(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="caches"):
        write_kv_cache(k, k, torch.zeros(4, 2, 2, 32), torch.zeros(4, 2, 2, 32), torch.tensor([0, 1]))
