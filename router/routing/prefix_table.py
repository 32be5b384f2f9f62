"""The ``prefix`` policy: route by what this router *guesses* each replica has cached.

The router remembers, for the block hashes of the prompts it sent, which
replica it sent them to (bounded, least recently used first out), and sends a
prompt to the replica of its longest remembered prefix unless that replica is
busier than the least loaded one by more than ``balance_slack`` sequences.
This is how text-matching prefix routers work (SGLang's, Ray Serve LLM's); it
never hears about evictions, other routers' requests or restarts, so its guess
drifts from the caches. It is here as the baseline that ``kv`` routing, which
reads the workers' own KV events, is compared with.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pagefleet.router.routing.policies import ReplicaLoad, rank_replicas

PREFIX_REASONS = ("cached_prefix", "balance", "no_match")  # every reason ``PrefixTable.rank`` gives


class PrefixTable:
    def __init__(self, capacity: int = 200_000, balance_slack: int = 8) -> None:
        self.capacity = capacity
        self.balance_slack = balance_slack
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> replica it was sent to

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, block_hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """The replica holding the longest remembered leading run of ``block_hashes``, and its length."""
        owner = self._owner.get(block_hashes[0]) if block_hashes else None
        if owner is None:
            return None, 0
        n = 1
        while n < len(block_hashes) and self._owner.get(block_hashes[n]) == owner:
            n += 1
        return owner, n

    def rank(self, block_hashes: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> tuple[list[str], str]:
        """Replica ids best first, and why: ``cached_prefix`` (the replica this router sent the
        longest prefix to), ``balance`` (that replica is too busy: least loaded instead) or
        ``no_match`` (nothing remembered: least loaded)."""
        ranked = rank_replicas(loads)
        owner, _ = self.longest_match(block_hashes)
        by_id = {r.replica_id: r for r in loads}
        if owner is None or owner not in by_id or not ranked:
            return ranked, "no_match"
        if by_id[owner].num_queued > by_id[ranked[0]].num_queued + self.balance_slack:
            return ranked, "balance"
        return [owner] + [r for r in ranked if r != owner], "cached_prefix"

    def record(self, block_hashes: Sequence[bytes], replica_id: str) -> None:
        owner = self._owner
        for h in block_hashes:
            owner[h] = replica_id
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def forget_replica(self, replica_id: str) -> None:
        for h in [h for h, r in self._owner.items() if r == replica_id]:
            del self._owner[h]
