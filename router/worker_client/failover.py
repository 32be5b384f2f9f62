"""What a request's stream needs to move to another replica mid-way: how far each sequence got."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.outputs import RequestOutputDelta


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    finished: bool = False


class StreamProgress:
    """Per sequence of one request: the tokens and text the ingress has received, and whether it
    finished. Sequences the engine has not reported yet (n > 1, none out) count as unstarted."""

    def __init__(self, n: int) -> None:
        self._seqs = [_Sequence() for _ in range(n)]
        # Engines that died while running this request: past MAX_ENGINE_DEATHS it is the likely
        # cause, and is not sent to another one (``HandleWorkerClient._follow``).
        self.engine_deaths = 0

    def add(self, delta: RequestOutputDelta) -> None:
        for out in delta.sequences:
            seq = self._seqs[out.index]
            seq.token_ids.extend(out.token_ids)
            seq.text_chars += len(out.text)
            seq.finished = seq.finished or out.finish_reason is not None

    def unfinished(self) -> list[tuple[int, ResumeState]]:
        """(index, where it goes on from) of each sequence not finished yet."""
        return [(i, ResumeState(list(s.token_ids), s.text_chars, i)) for i, s in enumerate(self._seqs)
                if not s.finished]
