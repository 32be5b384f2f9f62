"""The engine step: schedule, run, sample, detokenize, collect finished — no Ray, no threads."""

from __future__ import annotations

import logging
import time
from itertools import count
from typing import TYPE_CHECKING, Callable

import torch
from transformers import AutoTokenizer

from pagefleet.worker.core.block_hash import HASH_SIZE, extra_keys_digest, unpack_hashes
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.kv_cache_sizing import size_kv_pool
from pagefleet.worker.core.kv_events import KVEventBatch, KVEventLog, KVEventSource, KVLoad, KVSnapshot
from pagefleet.worker.core.resume import ResumeState, check_resume
from pagefleet.worker.core.scheduler import Scheduler, SchedulerOutput
from pagefleet.worker.core.sequence import Sequence, finish_reason
from pagefleet.worker.core.worker_load import worker_load
from pagefleet.worker.engine.async_scheduling import launch_next
from pagefleet.worker.engine.detokenizer import IncrementalDetokenizer
from pagefleet.worker.engine.engine_args import EngineArgs
from pagefleet.worker.engine.greedy_window import run_greedy_window
from pagefleet.worker.engine.resumed import ResumedStart, new_detokenizer, resumed_start
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.model_executor.model_config import model_config_of
from pagefleet.worker.model_executor.sampler import Sampler
from pagefleet.worker.model_executor.simulated_sampler import SimulatedSampler
from pagefleet.worker.model_executor.step_input import build_step_input
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.parallel.executor import make_executor
from pagefleet.worker.request_check import InvalidRequest, RequestLimits, check_request
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.structured.grammar_cache import GrammarCache
from pagefleet.worker.structured.matcher import SequenceGrammar

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.model_config = cfg = model_config_of(args)
        self.limits = RequestLimits.of(cfg, args)
        self.tokenizer = AutoTokenizer.from_pretrained(str(cfg.path), trust_remote_code=False)
        torch.manual_seed(args.seed)
        self.executor = make_executor(cfg, args, self.device)
        try:
            num_blocks, per_block = self._size_kv_cache()
        except BaseException:
            self.executor.shutdown()  # TP actors and process groups must not outlive a failed start
            raise
        self.pool = BlockPool(num_blocks, args.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, args.block_size)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        if args.simulate is None:
            self.sampler: Sampler | SimulatedSampler = Sampler(cfg.eos_token_ids)
        else:  # the simulated GPU returns no logits: tokens are drawn, over the tokenizer's ids
            self.sampler = SimulatedSampler(cfg.eos_token_ids, min(len(self.tokenizer), cfg.vocab_size),
                                            cfg.vocab_size, args.seed)
        # Grammars are compiled for the logits' width; a complete grammar ends at the model's EOS.
        self.grammars = GrammarCache(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        tokens = num_blocks * args.block_size
        logger.info("%s on %s: KV cache (per rank) of %d blocks = %d tokens (%.1f MiB); maximum concurrency at "
                    "max_model_len %d: %.2fx", cfg.architecture,
                    self.device if args.simulate is None else f"a simulated {args.simulate}", num_blocks, tokens,
                    num_blocks * per_block / 2**20, cfg.max_model_len, tokens / cfg.max_model_len)
        self.requests: dict[str, list[Sequence]] = {}
        self.detok: dict[int, IncrementalDetokenizer] = {}
        # Output tokens each sequence generated here and handed out; None once its finish was reported.
        self._sent: dict[int, int | None] = {}
        # Resumed requests that were finished when they arrived: the next step reports them.
        self._finished_on_arrival: set[str] = set()
        self._seq_ids = count()
        self.kv_events: KVEventSource | None = None  # set by enable_kv_events
        self.num_steps = 0
        # async_output_proc: the previous step's sequences whose outputs wait (detokenize, stop
        # strings) and the request ids its deltas cover.
        self.async_output = args.async_output_proc if args.async_output_proc is not None else (
            self.device.type == "cuda" or args.simulate is not None)
        self._deferred: tuple[list[Sequence], set[str]] | None = None
        # async_scheduling: the step launched before the last one's tokens reached the host
        # (async_scheduling.py), as its scheduler output and the executor's return.
        self.async_scheduling = self._async_scheduling()
        self._ahead: tuple[SchedulerOutput, object] | None = None
        # Takes the previous step's deltas as soon as they are built, while this step's device work
        # runs, rather than from step()'s return once it has finished: without it a token would
        # reach its client a whole step after it was made. None: step() returns them.
        self.on_early_outputs: Callable[[list[RequestOutputDelta]], None] | None = None
        # Recent seconds per step that ran something (moving average; 0 until one ran): the KV
        # events publish it, so admission control can tell when running sequences will end.
        self.step_time_s = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _async_scheduling(self) -> bool:
        """``args.async_scheduling``, resolved: on by default where it applies."""
        args = self.args
        applies = self.async_output and self.executor.reads_device_tokens and args.num_scheduler_steps == 1
        if args.async_scheduling and not applies:
            raise ValueError("async_scheduling needs async output processing, one rank (tensor_parallel_size 1) "
                             "and num_scheduler_steps 1")
        return applies if args.async_scheduling is None else args.async_scheduling

    def _size_kv_cache(self) -> tuple[int, int]:
        args = self.args
        per_block = self.executor.kv_bytes_per_block(args.block_size)
        budget = self.executor.available_kv_bytes(args.kv_cache_bytes, args.gpu_memory_utilization,
                                                  args.max_num_batched_tokens)
        pool = size_kv_pool(budget, per_block, args.block_size, self.model_config.max_model_len)
        self.executor.allocate_kv_cache(pool.num_blocks, args.block_size)
        return pool.num_blocks, per_block

    # ---- requests -------------------------------------------------------------------------

    def check(self, prompt_token_ids: list[int], params: SamplingParams, block_hashes: bytes = b"",
              resume: ResumeState | None = None) -> None:
        """Raise InvalidRequest (or ValueError, for ``block_hashes``) for a request that can never be
        served: the shared request check, plus what only the engine knows (its pool must hold the
        longest sequence)."""
        check_request(prompt_token_ids, params, self.limits)
        if resume is not None:
            check_resume(prompt_token_ids, params, resume, self.limits)
        full_blocks = len(prompt_token_ids) // self.args.block_size
        if len(block_hashes) % HASH_SIZE or len(block_hashes) // HASH_SIZE > full_blocks:
            raise ValueError(f"{len(block_hashes)} bytes of packed block hashes for a prompt of "
                             f"{len(prompt_token_ids)} tokens (16 bytes a full block)")
        max_len = self.limits.max_model_len
        longest = min(max_len, len(prompt_token_ids) + (params.max_tokens or max_len))
        if -(-longest // self.args.block_size) > self.pool.num_blocks:
            raise InvalidRequest(f"a sequence of {longest} tokens needs more KV blocks than the whole pool "
                                 f"({self.pool.num_blocks} blocks of {self.args.block_size})", "max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    extra_keys: tuple = (), block_hashes: bytes = b"", resume: ResumeState | None = None) -> None:
        """``block_hashes``: the prompt's full-block hashes under ``extra_keys``, packed
        (``block_hash.pack_hashes``), when the caller (the ingress) has computed them already; the
        engine then does not hash them again. ``resume``: continue the one sequence (n = 1) another
        replica had generated this far (``core.resume``); its deltas carry only what comes after."""
        self.check(prompt_token_ids, params, block_hashes, resume)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        resumed = None if resume is None else resumed_start(self.tokenizer, prompt_token_ids, params, resume, grammar)
        self.add_checked_request(request_id, prompt_token_ids, params, extra_keys, block_hashes, grammar, resumed)

    def add_checked_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            extra_keys: tuple = (), block_hashes: bytes = b"",
                            grammar: "xgr.CompiledGrammar | None" = None,
                            resumed: ResumedStart | None = None) -> None:
        """``add_request`` for a request that passed ``check`` already, with its structured_outputs'
        grammar compiled already and a resumed sequence's start built (``AsyncLLMEngine`` does all
        three on the caller's side, before it queues the request for the engine thread: the step
        loop never waits on a compile or a replay)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if (grammar is None) != (params.structured_outputs is None):
            raise ValueError("a request with structured_outputs is added with its compiled grammar "
                             "(self.grammars.compile), and only such a request")
        hashes = unpack_hashes(block_hashes)
        extra = extra_keys_digest(extra_keys)
        seqs: list[Sequence] = []
        for i in range(params.n):
            if resumed is None:
                seq = Sequence(next(self._seq_ids), request_id, i, prompt_token_ids, params,
                               parent=seqs[0] if seqs else None, extra_digest=extra,
                               grammar=None if grammar is None else SequenceGrammar(grammar))
                detok = new_detokenizer(self.tokenizer, prompt_token_ids, params)
            else:  # n == 1 (check_resume)
                seq = Sequence(next(self._seq_ids), request_id, resumed.seq_index, prompt_token_ids, params,
                               extra_digest=extra, grammar=resumed.grammar,
                               resumed_token_ids=resumed.output_token_ids)
                detok = resumed.detokenizer
            if hashes:
                seq.block_hashes = list(hashes)  # each sequence extends its own list
            self.detok[seq.seq_id] = detok
            self.scheduler.add(seq)
            seqs.append(seq)
        self.requests[request_id] = seqs
        # The replay of resumed outputs is prefill work: counted as prompt tokens.
        self.prompt_tokens_total += seqs[0].num_tokens
        if self.kv_events is not None:
            self.kv_events.request_added(request_id)
        if resumed is not None and seqs[0].num_resumed_tokens:
            seq = seqs[0]
            reason = finish_reason(seq, resumed.stop_str, self.model_config.eos_token_ids,
                                   self.model_config.max_model_len)
            if reason is not None:  # done by its own rules before this engine computed anything
                self.scheduler.finish(seq, *reason)
                self._finished_on_arrival.add(request_id)

    def abort_request(self, request_id: str) -> RequestOutputDelta | None:
        """Finish every sequence of the request with reason "abort" and free its blocks."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        if self._deferred is not None:  # its last token's text first, as a step would have made it
            for seq in self._deferred[0]:
                if seq.request_id == request_id and not seq.is_finished:
                    self.postprocess(seq)
            self._deferred = ([q for q in self._deferred[0] if q.request_id != request_id], self._deferred[1])
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        self._finished_on_arrival.discard(request_id)
        return self._collect({request_id})[0]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutputDelta]:
        """Schedule, execute, update, collect: one forward pass over the scheduled sequences
        (under async scheduling, possibly the one the previous call launched)."""
        arrived_done, self._finished_on_arrival = self._finished_on_arrival, set()
        started = time.monotonic()
        earlier: list[RequestOutputDelta] = []
        if self._ahead is not None:
            (out, logits), self._ahead = self._ahead, None
        else:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return self._finish_deferred() + self._collect(arrived_done)
            if self.args.num_scheduler_steps > 1:
                earlier = self._hand_early(self._finish_deferred())
                done = run_greedy_window(self, out, started)
                if done is not None:
                    return earlier + self._collect(done | arrived_done)
            step = build_step_input(out, self.args.block_size, self.kv.block_ids)
            try:
                logits = self.executor.execute(step)
            except BaseException:
                self.kv.unpublish_step()  # blocks hashed for this step hold no valid KV
                raise
        # Asynchronous devices (CUDA, a simulated GPU) are computing now: the host finishes the
        # previous step's outputs meanwhile.
        earlier = self._hand_early(earlier + self._finish_deferred())
        self.kv.commit_step()
        sampled_seqs = out.sampled_seqs()
        sampled = None
        self.scheduler.advance(out)
        if sampled_seqs:
            drawn = self.sampler.draw(logits, sampled_seqs)
            if self.async_scheduling:
                self._ahead = launch_next(self, out, drawn)
            sampled = self.sampler.collect(drawn, sampled_seqs)
        got = self.scheduler.append_sampled(out, sampled)
        self.num_steps += 1
        took = time.monotonic() - started
        self.step_time_s = took if not self.step_time_s else 0.8 * self.step_time_s + 0.2 * took
        stepped = {item.seq.request_id for item in out.scheduled} | arrived_done
        if not self.async_output:
            for seq in got:
                self.postprocess(seq)
            return earlier + self._collect(stepped)
        # EOS, stop ids and lengths end sequences now, before the next schedule; the rest
        # (detokenizing, stop strings, the deltas) waits for the next step's device time, if a
        # next step there is.
        waiting = [seq for seq in got if not self._ends_now(seq)]
        if not (self.scheduler.running or self.scheduler.waiting):
            # Every sequence has ended: a step launched ahead computes only dropped tokens.
            self._ahead = None
            for seq in waiting:
                self.postprocess(seq)
            return earlier + self._collect(stepped)
        self._deferred = (waiting, stepped)
        return earlier

    def _ends_now(self, seq: Sequence) -> bool:
        """Finish ``seq`` now (detokenized, stop strings first, as ever) when its newest token ends
        it whatever the text says; True if it did."""
        if finish_reason(seq, None, self.model_config.eos_token_ids, self.model_config.max_model_len) is None:
            return False
        self.postprocess(seq)
        return True

    def _finish_deferred(self) -> list[RequestOutputDelta]:
        """The previous step's deferred outputs (``async_output_proc``): detokenize its sequences,
        end those a stop string ends (their token of the step now running is then dropped), and
        build its deltas."""
        if self._deferred is None:
            return []
        seqs, request_ids = self._deferred
        self._deferred = None
        for seq in seqs:
            if not seq.is_finished:  # an abort may have ended it since
                self.postprocess(seq)
        return self._collect(request_ids)

    def _hand_early(self, deltas: list[RequestOutputDelta]) -> list[RequestOutputDelta]:
        """``deltas`` to ``on_early_outputs`` now, if set (then none are left for step() to return)."""
        if deltas and self.on_early_outputs is not None:
            self.on_early_outputs(deltas)
            return []
        return deltas

    def postprocess(self, seq: Sequence) -> None:
        """Detokenize a sequence's new token and end it if that token stops it."""
        self.generation_tokens_total += 1
        allowed = seq.num_output_tokens >= seq.params.min_tokens
        stop_str = self.detok[seq.seq_id].update(seq.token_ids, check_stop=allowed)
        reason = finish_reason(seq, stop_str, self.model_config.eos_token_ids, self.model_config.max_model_len)
        if reason is not None:
            self.scheduler.finish(seq, *reason)

    def _collect(self, request_ids: set[str]) -> list[RequestOutputDelta]:
        """One delta per request, holding each sequence with new output or a new finish."""
        deltas = []
        for rid in request_ids:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue  # ended and reported while its last step ran (async_output_proc)
            parts = [d for d in (self._sequence_delta(seq) for seq in seqs) if d is not None]
            finished = all(s.is_finished for s in seqs)
            deltas.append(RequestOutputDelta(rid, parts, seqs[0].num_prompt_tokens, seqs[0].num_cached_tokens,
                                             finished))
            if finished:
                del self.requests[rid]
                for s in seqs:
                    del self.detok[s.seq_id]
                    self._sent.pop(s.seq_id, None)
        return deltas

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

    # ---- KV events (for a global scheduler) -------------------------------------------------

    def enable_kv_events(self, worker_id: str) -> None:
        """Record every change to the prefix cache from now on, as ``worker_id``'s batches.
        Only before the first request: the first batch says the cache starts empty."""
        if self.requests or self.pool.cached:
            raise RuntimeError("KV events must be enabled before the engine takes requests")
        self.pool.events = KVEventLog()
        self.kv_events = KVEventSource(worker_id, self.pool)

    def drain_kv_events(self) -> KVEventBatch | None:
        """The changes since the last drain as the next numbered batch (None: events are off)."""
        return None if self.kv_events is None else self.kv_events.drain(self.kv_load())

    def kv_snapshot(self) -> tuple[KVEventBatch, KVSnapshot]:
        """The prefix cache's whole state, and the batch it is valid after (see KVEventSource)."""
        if self.kv_events is None:
            raise RuntimeError("KV events are not enabled")
        return self.kv_events.snapshot(self.kv_load())

    def kv_load(self) -> KVLoad:
        """Sequences running and waiting, the blocks they will still take, and when the running
        ones end (``core.worker_load``)."""
        sched, args = self.scheduler, self.args
        return worker_load(sched.running, sched.waiting, self.kv.block_tables, args.block_size,
                           self.model_config.max_model_len, args.max_num_batched_tokens, self.step_time_s)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def check_health(self) -> None:
        """Raise if a tensor-parallel rank died, even while the engine is idle."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
