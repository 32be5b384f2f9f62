"""Ref-counted KV blocks, an O(1) LRU free queue, and the hash -> block map."""

from __future__ import annotations

from typing import Sequence

from pagefleet.worker.core.block_hash import BlockHash
from pagefleet.worker.core.kv_events import KVEventLog


class KVBlock:
    """One fixed-size slice of every layer's KV pool. Links make the free queue O(1)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (least recently freed first)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels keep insert/remove branch-free
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """All blocks of the KV pool. A block with ref_cnt 0 is free; if it still has a
    hash it is also a cached prefix until the queue hands it out again (evicted).

    With an ``events`` log, every change to the set of cached hashes, and to
    whether a cached block is in use or idle, is recorded there (for the global
    scheduler); without one, nothing is recorded."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evicted = 0
        self.events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks with {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        self._forget(block)
        self.num_evicted += 1

    def _forget(self, block: KVBlock) -> None:
        # A block's hash, when set, is always its own entry in ``cached`` (``cache`` refuses duplicates).
        del self.cached[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (leaving the free queue if idle)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None and self.events is not None:
                    self.events.acquired(block.block_hash)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; callers pass a request's blocks tail-first so a
        prompt's last blocks are evicted before its shared head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None and self.events is not None:
                    self.events.released(block.block_hash)

    def cache(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] = ()) -> bool:
        """Publish a full block under its hash (first writer wins for duplicates); True if published.
        ``parent_hash`` and ``token_ids`` only go into the event log."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)  # in use: a sequence holds it
            if block.ref_cnt == 0:
                self.events.released(block_hash)
        return True

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block's hash (its KV turned out invalid); the block itself stays as it is."""
        if block.block_hash is not None:
            self._forget(block)

    def num_evictable(self, blocks: list[KVBlock]) -> int:
        """How many of these blocks sit in the free queue (touching them uses free capacity)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of every idle block (blocks in use keep theirs)."""
        everything = all(b.ref_cnt == 0 for b in self.cached.values())
        for block in self.free_queue:
            self._evict(block)
        if everything and self.events is not None:
            self.events.cleared()  # one "cleared" replaces the removal of each hash
