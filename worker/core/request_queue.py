"""The waiting queue's order and the preemption victim, by scheduling policy (vLLM's
``--scheduling-policy``).

``fcfs``: waiting sequences are admitted in arrival order, a preempted one goes back to the
front, and the newest running sequence is preempted first. ``priority``: waiting sequences are
admitted by (priority, arrival), lower values first, a preempted one takes its place by that
key again, and the running sequence with the highest (priority, arrival) is preempted first.
A sequence's arrival is its ``seq_id``: the engine numbers sequences as they are added.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable, Iterator

from pagefleet.worker.core.sequence import Sequence

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Lower is served earlier and preempted later: the priority, then the arrival."""
    return seq.priority, seq.seq_id


class FCFSQueue:
    """Arrival order; a preempted or skipped sequence goes back to the front."""

    def __init__(self) -> None:
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def prepend(self, seqs: Iterable[Sequence]) -> None:
        """Put ``seqs`` back at the front, in their order."""
        self._seqs.extendleft(reversed(list(seqs)))

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        return self._seqs.popleft()

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The running sequence to preempt first: the newest one admitted."""
        return running[-1]

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)


class PriorityQueue:
    """(priority, arrival) order, lowest first, whenever a sequence was added or put back."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []  # seq_ids are unique: a Sequence is never compared

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (*priority_key(seq), seq))

    def prepend(self, seqs: Iterable[Sequence]) -> None:
        """A priority queue has no front: each goes back to its place by its key."""
        for seq in seqs:
            self.add(seq)

    def peek(self) -> Sequence:
        return self._heap[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The running sequence to preempt first: the highest (priority, arrival)."""
        return max(running, key=priority_key)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In the order they would be admitted."""
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


def waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
