"""Output processing: a sampled token becomes text (detokenizing, stop strings), ends its
sequence where it stops it, and requests' new output goes out as ``RequestOutputDelta``.

It holds what only outputs need: each request's sequences and each sequence's detokenizer,
how much of each sequence was handed out, and resumed requests finished on arrival, which the
next step reports. Under async output processing a step's outputs wait for the next step's
device time (``DeferredOutputs``); ``on_early_outputs`` then takes them as soon as they are made.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence, finish_reason
from pagefleet.worker.engine.detokenizer import IncrementalDetokenizer
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta


class DeferredOutputs(NamedTuple):
    """A step's outputs left for the next step's device time (async output processing)."""

    seqs: list[Sequence]  # got a token whose text and stop strings are not checked yet
    request_ids: set[str]  # the requests the step's deltas cover


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.scheduler = scheduler  # ends the sequences a token stops
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, list[Sequence]] = {}
        self.detok: dict[int, IncrementalDetokenizer] = {}
        # Output tokens each sequence generated here and handed out; None once its finish was reported.
        self._sent: dict[int, int | None] = {}
        # Resumed requests that were finished when they arrived: the next step reports them.
        self.finished_on_arrival: set[str] = set()
        self._prompt_logprobs_sent: set[str] = set()  # requests whose prompt logprobs went out
        # Takes the previous step's deltas as soon as they are built, while this step's device work
        # runs, rather than from step()'s return once it has finished: without it a token would
        # reach its client a whole step after it was made. None: step() returns them.
        self.on_early_outputs: Callable[[list[RequestOutputDelta]], None] | None = None
        self.generation_tokens_total = 0

    def add_request(self, request_id: str, seqs: list[Sequence], detoks: list[IncrementalDetokenizer]) -> None:
        for seq, detok in zip(seqs, detoks, strict=True):
            self.detok[seq.seq_id] = detok
        self.requests[request_id] = seqs

    def take_finished_on_arrival(self) -> set[str]:
        taken, self.finished_on_arrival = self.finished_on_arrival, set()
        return taken

    def postprocess(self, seq: Sequence) -> None:
        """Detokenize a sequence's new token and end it if that token stops it."""
        self.generation_tokens_total += 1
        allowed = seq.num_output_tokens >= seq.params.min_tokens
        stop_str = self.detok[seq.seq_id].update(seq.token_ids, check_stop=allowed)
        reason = finish_reason(seq, stop_str, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(seq, *reason)

    def ends_now(self, seq: Sequence) -> bool:
        """Finish ``seq`` now (detokenized, stop strings first, as ever) when its newest token ends
        it whatever the text says; True if it did."""
        if finish_reason(seq, None, self.eos_token_ids, self.max_model_len) is None:
            return False
        self.postprocess(seq)
        return True

    def finish_deferred(self, deferred: DeferredOutputs | None) -> list[RequestOutputDelta]:
        """A step's deferred outputs: detokenize its sequences, end those a stop string ends
        (their token of the step now running is then dropped), and build its deltas."""
        if deferred is None:
            return []
        for seq in deferred.seqs:
            if not seq.is_finished:  # an abort may have ended it since
                self.postprocess(seq)
        return self.collect(deferred.request_ids)

    def drop_deferred(self, deferred: DeferredOutputs, request_id: str) -> DeferredOutputs:
        """``deferred`` less ``request_id``'s sequences, whose last token's text is made first,
        as a step would have made it (the request is being aborted)."""
        for seq in deferred.seqs:
            if seq.request_id == request_id and not seq.is_finished:
                self.postprocess(seq)
        return DeferredOutputs([q for q in deferred.seqs if q.request_id != request_id], deferred.request_ids)

    def hand_early(self, deltas: list[RequestOutputDelta]) -> list[RequestOutputDelta]:
        """``deltas`` to ``on_early_outputs`` now, if set (then none are left for step() to return)."""
        if deltas and self.on_early_outputs is not None:
            self.on_early_outputs(deltas)
            return []
        return deltas

    def collect(self, request_ids: set[str]) -> list[RequestOutputDelta]:
        """One delta per request, holding each sequence with new output or a new finish."""
        deltas = []
        for rid in request_ids:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue  # ended and reported while its last step ran (async output processing)
            parts = [d for d in (self._sequence_delta(seq) for seq in seqs) if d is not None]
            finished = all(s.is_finished for s in seqs)
            deltas.append(RequestOutputDelta(rid, parts, seqs[0].num_prompt_tokens, seqs[0].num_cached_tokens,
                                             finished, self._prompt_logprobs(rid, seqs[0], bool(parts))))
            if finished:
                self._prompt_logprobs_sent.discard(rid)
                del self.requests[rid]
                for s in seqs:
                    del self.detok[s.seq_id]
                    self._sent.pop(s.seq_id, None)
        return deltas

    def _prompt_logprobs(self, request_id: str, first: Sequence, with_output: bool) -> list | None:
        """The request's prompt logprobs, in its first delta with output (a resumed sequence's went
        out from the replica that started it)."""
        if (first.prompt_logprobs is None or first.num_resumed_tokens or not with_output
                or request_id in self._prompt_logprobs_sent):
            return None
        self._prompt_logprobs_sent.add(request_id)
        return first.prompt_logprobs

    def _sequence_delta(self, seq: Sequence) -> CompletionOutput | None:
        sent = self._sent.get(seq.seq_id, 0)
        if sent is None:
            return None  # finished and already reported
        text = self.detok[seq.seq_id].take_new_text(seq.is_finished)
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_resumed_tokens + sent:]
        if not new_ids and not text and not seq.is_finished:
            return None
        self._sent[seq.seq_id] = None if seq.is_finished else sent + len(new_ids)
        lps = seq.logprobs[sent:] if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, new_ids, lps, seq.finish_reason, seq.stop_reason)
