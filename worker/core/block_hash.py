"""The chained block hash shared by worker, router and global scheduler.

A block's hash covers its parent's hash, its token ids and any extra keys
that change KV content (a per-tenant cache salt, say; the LoRA adapter, so
no prefix is shared across adapters or with the base model). It is deterministic
across processes and machines: blake2b over a fixed byte encoding, never
Python's ``hash()``.

A prompt's hashes cross processes in one form, packed: the 16-byte hashes
concatenated (``pack_hashes``). The ingress packs them once; routers read the
packed bytes; the engine unpacks them once, when it takes the request in.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as SequenceABC
from hashlib import blake2b
from typing import Iterable, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)

HASH_SIZE = 16  # bytes
# The parent of a sequence's first block: the chain starts here.
ROOT_HASH = BlockHash(b"\x00" * HASH_SIZE)


# Marks the adapter's name in the digest: no extra key's length prefix can equal it (a key
# would be 4 GiB long), so no cache salt can pose as an adapter.
_LORA_MARK = struct.pack("<I", 0xFFFFFFFF)


def extra_keys_digest(extra_keys: tuple = (), lora_name: str | None = None) -> bytes:
    """What a request's extra keys and its LoRA adapter (``lora_name``; None: the base model) add
    to each of its block hashes, hashed once per request, so that a block costs the same whatever
    the keys' length; b"" for neither."""
    if not extra_keys and lora_name is None:
        return b""
    h = blake2b(digest_size=HASH_SIZE, person=b"pagefleet-xkeys")
    for key in extra_keys:
        data = key if isinstance(key, bytes) else str(key).encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    if lora_name is not None:
        name = lora_name.encode()
        h.update(_LORA_MARK)
        h.update(struct.pack("<I", len(name)))
        h.update(name)
    return h.digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """``extra``: the request's ``extra_keys_digest``."""
    h = blake2b(digest_size=HASH_SIZE, person=b"pagefleet-kv")
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return BlockHash(h.digest())


def block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                 start: Iterable[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` under ``extra`` (an ``extra_keys_digest``);
    ``start`` are already-known leading hashes."""
    hashes = list(start)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def pack_hashes(hashes: Iterable[BlockHash]) -> bytes:
    return b"".join(hashes)


def unpack_hashes(packed: bytes) -> list[BlockHash]:
    _check_packed(packed)
    return [BlockHash(packed[i:i + HASH_SIZE]) for i in range(0, len(packed), HASH_SIZE)]


def _check_packed(packed: bytes) -> None:
    if len(packed) % HASH_SIZE:
        raise ValueError(f"packed hashes must be a multiple of {HASH_SIZE} bytes, got {len(packed)}")


class PackedHashes(SequenceABC):
    """Packed hashes read in place, as a sequence (a router that looks at a prompt's first few
    blocks reads those and builds nothing)."""

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        _check_packed(packed)
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // HASH_SIZE

    def __getitem__(self, i: int) -> BlockHash:  # type: ignore[override]  # no slices
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        start = (i % len(self)) * HASH_SIZE
        return BlockHash(self.packed[start:start + HASH_SIZE])
