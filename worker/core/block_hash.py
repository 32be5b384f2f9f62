"""The chained block hash shared by worker, router and global scheduler.

A block's hash covers its parent's hash, its token ids and any extra keys
that change KV content (a per-tenant cache salt, say). It is deterministic
across processes and machines: blake2b over a fixed byte encoding, never
Python's ``hash()``.
"""

from __future__ import annotations

import struct
from hashlib import blake2b
from typing import Iterable, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)

HASH_SIZE = 16  # bytes
# The parent of a sequence's first block: the chain starts here.
ROOT_HASH = BlockHash(b"\x00" * HASH_SIZE)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    h = blake2b(digest_size=HASH_SIZE, person=b"pagefleet-kv")
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        data = key if isinstance(key, bytes) else str(key).encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return BlockHash(h.digest())


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
                 start: Iterable[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; ``start`` are already-known leading hashes."""
    hashes = list(start)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
