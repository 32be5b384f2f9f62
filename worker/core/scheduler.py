"""Continuous batching: spend a token budget on running sequences first, then admit
waiting ones, chunking long prompts; preempt by recompute when blocks run out. Which waiting
sequence comes first and which running one is preempted is the scheduling policy's
(``request_queue``: the newest under fcfs, the worst priority under priority)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.request_queue import waiting_queue
from pagefleet.worker.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagefleet.worker.sample.sampler import SamplerOutput


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    sample: bool  # this step computes the sequence's last token, so its next token is sampled


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # A step scheduled ahead (``Scheduler.schedule_ahead``): its first len(prev_token_rows)
    # sequences compute the token the step before samples for them, in these of its rows.
    prev_token_rows: list[int] = field(default_factory=list)

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences whose next token this step samples, in logits-row order."""
        return [s.seq for s in self.scheduled if s.sample]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_loras: int | None = None) -> None:
        """``max_loras``: LoRA adapters among the running sequences at most (the GPU slots; None:
        LoRA is off): a waiting sequence whose adapter would be one too many waits, and those behind
        it may go first."""
        self.kv = kv
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = waiting_queue(policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences are scheduled in their order: the first len(out.scheduled) are done.
        while len(out.scheduled) < len(self.running) and budget > 0:
            seq = self.running[len(out.scheduled)]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            given_back = self._make_room(seq, num_new, out)
            if given_back is None:
                break  # seq itself was preempted: as in vLLM, the rest wait for the next step
            out.scheduled.append(_scheduled(seq, num_new))
            budget += given_back - num_new
        if out.preempted:
            # Blocks are short: admitting new work now would only preempt again.
            return out
        self.admit(out, budget)
        return out

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> int | None:
        """Allocate ``seq``'s blocks for ``num_new`` tokens, preempting running sequences as the
        policy picks them until they fit. Returns the tokens given back by victims scheduled
        earlier in this step (the priority policy may pick one), or None when ``seq`` itself was
        preempted."""
        given_back = 0
        while not self.kv.allocate(seq, num_new):
            victim = self.waiting.victim(self.running)
            self.running.remove(victim)
            item = next((item for item in out.scheduled if item.seq is victim), None)
            if item is not None:
                out.scheduled.remove(item)
                given_back += item.num_new_tokens
                self.kv.withdraw_step(victim)  # hashes published for KV this step will not write
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return None
        return given_back

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences into ``out`` while seats, ``budget`` tokens and blocks last,
        in the policy's order (the second half of ``schedule``; async scheduling's launches ahead
        call it alone)."""
        skipped: list[Sequence] = []
        loras = self._running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq.parent is not None and not self._parent_ready(seq.parent):
                skipped.append(self.waiting.pop())  # wait to share the parent's prompt blocks
                continue
            lora = seq.lora_request
            if (lora is not None and self.max_loras is not None and lora.lora_int_id not in loras
                    and len(loras) >= self.max_loras):
                skipped.append(self.waiting.pop())  # every slot is taken by running adapters
                continue
            prefix = self.kv.find_prefix(seq)
            num_new = min(seq.num_tokens - prefix.num_tokens, budget)
            if not self.kv.allocate(seq, num_new, prefix):
                break
            self.waiting.pop()
            if seq.num_computed_tokens == 0 and seq.num_new_output_tokens == 0:
                seq.num_cached_tokens = prefix.num_tokens
            seq.num_computed_tokens = prefix.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(_scheduled(seq, num_new))
            budget -= num_new
            if lora is not None:
                loras.add(lora.lora_int_id)
        self.waiting.prepend(skipped)

    def _running_loras(self) -> set[int]:
        return {seq.lora_request.lora_int_id for seq in self.running if seq.lora_request is not None}

    def schedule_ahead(self, out: SchedulerOutput, max_model_len: int) -> SchedulerOutput | None:
        """The step to launch after ``out`` before its sampled tokens reach the host (async
        scheduling; ``out`` is launched and counted as computed, so a sequence's prompt done in it
        lets its parallel samples in): one more token of each sequence ``out`` samples, read on
        the device from ``out``'s sampled rows, then waiting sequences as ``admit`` takes them.
        None where nothing is to be launched: ``out`` computes prompt that samples nothing, a
        sequence lacks a block for its next token, or nothing is left to run. A sequence ended
        already, or ended by length by the token being sampled, is left out."""
        if not all(item.sample for item in out.scheduled):
            return None
        ahead = SchedulerOutput()
        for row, item in enumerate(out.scheduled):  # every item samples: rows are the sampled tokens' rows
            seq = item.seq
            if seq.is_finished or seq.num_tokens + 1 >= max_model_len or (
                    seq.params.max_tokens is not None and seq.num_output_tokens + 1 >= seq.params.max_tokens):
                continue
            # Room for the next token (the launched step's tokens count as computed already).
            if not self.kv.allocate(seq, 1):
                return None
            ahead.prev_token_rows.append(row)
            ahead.scheduled.append(ScheduledSeq(seq, 1, True))
        self.admit(ahead, self.max_num_batched_tokens - len(ahead.prev_token_rows))
        return ahead if ahead.scheduled else None

    def update_from_output(self, out: SchedulerOutput, sampled: "SamplerOutput | None") -> list[Sequence]:
        """After the step ran: advance each scheduled sequence's progress and append the sampled
        tokens (``sampled`` rows are ``out.sampled_seqs()``), except to sequences that ended while the
        step ran. Returns the sequences that got a token."""
        self.advance(out)
        return self.append_sampled(out, sampled)

    @staticmethod
    def advance(out: SchedulerOutput) -> None:
        """Count ``out``'s tokens as computed: once its step is launched, as the device runs steps in
        order (async scheduling advances before the tokens are known)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens

    def append_sampled(self, out: SchedulerOutput, sampled: "SamplerOutput | None") -> list[Sequence]:
        """The second half of ``update_from_output``: append the sampled tokens. A sequence whose
        row had no token to sample ends here: "stop" where its grammar allows nothing more,
        "abort" where its logits were not finite."""
        if sampled is None:
            return []
        got = []
        for seq, token, logprob in zip(out.sampled_seqs(), sampled.token_ids, sampled.logprobs, strict=True):
            if seq.is_finished:
                continue  # ended while this step ran (a stop string found late): its token is dropped
            if token is None:
                self.finish(seq, "stop" if seq.grammar is not None else "abort")
                continue
            if seq.params.max_tokens == 0:  # the prompt alone was asked for (prompt_logprobs)
                self.finish(seq, "length")
                continue
            seq.append_token(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            got.append(seq)
        return got

    @staticmethod
    def _parent_ready(parent: Sequence) -> bool:
        return (parent.status is not SequenceStatus.WAITING
                and (parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.prepend([seq])
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a sequence wherever it is and give its blocks back."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason


def _scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
    return ScheduledSeq(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)
