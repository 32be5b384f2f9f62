"""The engine step: schedule, run, sample, detokenize, collect finished — no Ray, no threads."""

from __future__ import annotations

import logging
from itertools import count
from typing import TYPE_CHECKING, Callable

import torch
from transformers import AutoTokenizer

from pagefleet.worker.core.block_hash import HASH_SIZE, extra_keys_digest, unpack_hashes
from pagefleet.worker.core.block_pool import BlockPool
from pagefleet.worker.core.kv_cache_manager import KVCacheManager
from pagefleet.worker.core.kv_cache_sizing import max_blocks_per_seq, max_tokens_held, size_kv_pool, step_tokens
from pagefleet.worker.core.kv_events import KVEventBatch, KVEventLog, KVEventSource, KVLoad, KVSnapshot
from pagefleet.worker.core.resume import ResumeState, check_resume
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence, finish_reason
from pagefleet.worker.core.worker_load import worker_load
from pagefleet.worker.engine.greedy_window import WindowedStep
from pagefleet.worker.engine.output_processor import OutputProcessor
from pagefleet.worker.engine.overlapped_step import OverlappedStep
from pagefleet.worker.engine.resumed import ResumedStart, new_detokenizer, resumed_start
from pagefleet.worker.engine.step_loop import InFlight, PlainStep, StepFn, StepParts
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.metrics.stats import EngineStats
from pagefleet.worker.model_executor.model_config import model_config_of
from pagefleet.worker.model_executor.simulated_sampler import SimulatedSampler
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.parallel.executor import make_executor
from pagefleet.worker.request_check import (
    MODEL_NOT_FOUND,
    InvalidRequest,
    RequestLimits,
    check_priority,
    check_request,
)
from pagefleet.worker.sample.sampler import Sampler
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
        self.kv = KVCacheManager(self.pool, args.block_size, cfg.kv_sliding_window)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy,
                                   max_loras=args.max_loras if args.enable_lora else None)
        if args.simulate is None:
            self.sampler: Sampler | SimulatedSampler = Sampler(cfg.eos_token_ids, self.tokenizer)
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
        self._seq_ids = count()
        self.kv_events: KVEventSource | None = None  # set by enable_kv_events
        self.outputs = OutputProcessor(self.scheduler, cfg.eos_token_ids, cfg.max_model_len)
        self.async_output = args.async_output_proc if args.async_output_proc is not None else (
            self.device.type == "cuda" or args.simulate is not None)
        self.async_scheduling = self._async_scheduling()
        self._parts = StepParts(self.scheduler, self.kv, self.executor, self.sampler, self.outputs,
                                args.block_size, cfg.max_model_len)
        self._step_fn = self._pick_step_fn()
        self._in_flight: InFlight | None = None  # what the last step handed the next
        self.prompt_tokens_total = 0
        self.loras: dict[int, LoRARequest] = {}  # adapters registered on every rank, by lora_int_id
        # Every adapter name ever served, with its path: the prefix cache keys blocks by name, so a
        # name never comes back with other weights while blocks cached under it may live.
        self._lora_paths: dict[str, str] = {}
        try:
            for i, module in enumerate(args.lora_modules or (), start=1):
                self.add_lora(LoRARequest(module.name, i, module.path, module.base_model_name))
        except BaseException:
            self.shutdown()
            raise

    def _pick_step_fn(self) -> StepFn:
        """The step function for the engine's options, decided once (``step_loop``)."""
        parts = self._parts
        base = OverlappedStep(parts, self.async_scheduling) if self.async_output else PlainStep(parts)
        steps = self.args.num_scheduler_steps
        return WindowedStep(parts, steps, base) if steps > 1 else base

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
        cfg = self.model_config
        pool = size_kv_pool(budget, per_block, args.block_size, cfg.max_model_len,
                            self._max_tokens_held(cfg.max_model_len))
        self.executor.allocate_kv_cache(pool.num_blocks, args.block_size)
        return pool.num_blocks, per_block

    def _max_tokens_held(self, num_tokens: int) -> int:
        """The KV a sequence of ``num_tokens`` holds at most (less with a window in every layer)."""
        args = self.args
        return max_tokens_held(num_tokens, args.block_size, self.model_config.kv_sliding_window,
                               step_tokens(args.max_num_batched_tokens, args.num_scheduler_steps))

    # ---- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Register an adapter on every rank, read and checked now (a ValueError says what is wrong
        with it). Its name and id are the engine's from then on: one name, one id, one path."""
        if not self.args.enable_lora:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: LoRA is not enabled (enable_lora)")
        known = self.loras.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is registered as {known.lora_name!r} "
                             f"({known.lora_path}), not {request.lora_name!r} ({request.lora_path})")
        same_name = next((r for r in self.loras.values() if r.lora_name == request.lora_name), None)
        if same_name is not None and same_name.lora_int_id != request.lora_int_id:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is registered with lora_int_id "
                             f"{same_name.lora_int_id} already")
        served = self._lora_paths.get(request.lora_name)
        if served is not None and served != request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} was served from {served}; its name cannot "
                             f"name {request.lora_path} in this engine (its cached KV blocks are keyed by name)")
        if known is None:
            self.executor.add_lora(request)
            self.loras[request.lora_int_id] = request
            self._lora_paths[request.lora_name] = request.lora_path

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on every rank; whether it was registered. A ValueError while a
        request (running or waiting) still runs with it."""
        request = self.loras.get(lora_int_id)
        if request is None:
            return False
        holders = [rid for rid, seqs in self.requests.items()
                   if any(s.lora_request is not None and s.lora_request.lora_int_id == lora_int_id for s in seqs)]
        if holders:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is in use by {len(holders)} request(s), e.g. "
                             f"{holders[0]!r}")
        self.executor.remove_lora(lora_int_id)
        del self.loras[lora_int_id]
        return True

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """The adapter served as ``name`` from ``path``, registered now under the next free id if
        it is not (a runtime load, or a request that carries an adapter this engine lacks)."""
        held = self.lora_held(name)
        if held is not None:
            if held.lora_path != path:
                raise ValueError(f"LoRA adapter {name!r} is served from {held.lora_path}, not {path}")
            return held
        request = LoRARequest(name, max(self.loras, default=0) + 1, path)
        self.add_lora(request)
        return request

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, by lora_int_id."""
        return [self.loras[i] for i in sorted(self.loras)]

    def lora_held(self, name: str) -> LoRARequest | None:
        """The registered adapter served as ``name`` (None: none). Safe off the engine thread: the
        values are copied in one call before they are searched."""
        return next((r for r in list(self.loras.values()) if r.lora_name == name), None)

    def lora_named(self, name: str) -> LoRARequest:
        """The registered adapter served as ``name``; an InvalidRequest (404-like, on ``model``) if none."""
        request = self.lora_held(name)
        if request is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded on this worker", "model",
                                 MODEL_NOT_FOUND)
        return request

    # ---- requests -------------------------------------------------------------------------

    def check(self, prompt_token_ids: list[int], params: SamplingParams, block_hashes: bytes = b"",
              resume: ResumeState | None = None, priority: int = 0) -> None:
        """Raise InvalidRequest (or ValueError, for ``block_hashes``) for a request that can never be
        served: the shared request check, plus what only the engine knows (its pool must hold the
        longest sequence)."""
        check_request(prompt_token_ids, params, self.limits)
        check_priority(priority, self.limits)
        if params.prompt_logprobs is not None and self.args.simulate is not None:
            raise InvalidRequest("prompt_logprobs needs the model's logits, which a simulated GPU does not compute",
                                 "prompt_logprobs")
        if resume is not None:
            check_resume(prompt_token_ids, params, resume, self.limits)
        full_blocks = len(prompt_token_ids) // self.args.block_size
        if len(block_hashes) % HASH_SIZE or len(block_hashes) // HASH_SIZE > full_blocks:
            raise ValueError(f"{len(block_hashes)} bytes of packed block hashes for a prompt of "
                             f"{len(prompt_token_ids)} tokens (16 bytes a full block)")
        max_len = self.limits.max_model_len
        longest = min(max_len, len(prompt_token_ids) + (params.max_tokens or max_len))
        if -(-self._max_tokens_held(longest) // self.args.block_size) > self.pool.num_blocks:
            raise InvalidRequest(f"a sequence of {longest} tokens needs more KV blocks than the whole pool "
                                 f"({self.pool.num_blocks} blocks of {self.args.block_size})", "max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    extra_keys: tuple = (), block_hashes: bytes = b"", resume: ResumeState | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """``block_hashes``: the prompt's full-block hashes under ``extra_keys`` and the adapter, packed
        (``block_hash.pack_hashes``), when the caller (the ingress) has computed them already; the
        engine then does not hash them again. ``resume``: continue the one sequence (n = 1) another
        replica had generated this far (``core.resume``); its deltas carry only what comes after.
        ``priority``: vLLM's (lower first), with ``scheduling_policy`` priority only.
        ``lora_request``: the LoRA adapter the request runs with (registered on first use,
        ``add_lora``); None: the base model."""
        self.check(prompt_token_ids, params, block_hashes, resume, priority)
        if lora_request is not None:
            self.add_lora(lora_request)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        resumed = None if resume is None else resumed_start(self.tokenizer, prompt_token_ids, params, resume, grammar)
        self.add_checked_request(request_id, prompt_token_ids, params, extra_keys, block_hashes, grammar, resumed,
                                 priority, lora_request)

    def add_checked_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            extra_keys: tuple = (), block_hashes: bytes = b"",
                            grammar: "xgr.CompiledGrammar | None" = None,
                            resumed: ResumedStart | None = None, priority: int = 0,
                            lora_request: LoRARequest | None = None) -> None:
        """``add_request`` for a request that passed ``check`` already, with its structured_outputs'
        grammar compiled already and a resumed sequence's start built (``AsyncLLMEngine`` does all
        three on the caller's side, before it queues the request for the engine thread: the step
        loop never waits on a compile or a replay)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if (grammar is None) != (params.structured_outputs is None):
            raise ValueError("a request with structured_outputs is added with its compiled grammar "
                             "(self.grammars.compile), and only such a request")
        if lora_request is not None and self.loras.get(lora_request.lora_int_id) != lora_request:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not registered (add_lora)")
        hashes = unpack_hashes(block_hashes)
        extra = extra_keys_digest(extra_keys, None if lora_request is None else lora_request.lora_name)
        seqs: list[Sequence] = []
        detoks = []
        for i in range(params.n):
            if resumed is None:
                seq = Sequence(next(self._seq_ids), request_id, i, prompt_token_ids, params,
                               parent=seqs[0] if seqs else None, extra_digest=extra,
                               grammar=None if grammar is None else SequenceGrammar(grammar), priority=priority,
                               lora_request=lora_request)
                detoks.append(new_detokenizer(self.tokenizer, prompt_token_ids, params))
            else:  # n == 1 (check_resume)
                seq = Sequence(next(self._seq_ids), request_id, resumed.seq_index, prompt_token_ids, params,
                               extra_digest=extra, grammar=resumed.grammar,
                               resumed_token_ids=resumed.output_token_ids, priority=priority,
                               lora_request=lora_request)
                detoks.append(resumed.detokenizer)
            if hashes:
                seq.block_hashes = list(hashes)  # each sequence extends its own list
            self.scheduler.add(seq)
            seqs.append(seq)
        self.outputs.add_request(request_id, seqs, detoks)
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
                self.outputs.finished_on_arrival.add(request_id)

    def abort_request(self, request_id: str) -> RequestOutputDelta | None:
        """Finish every sequence of the request with reason "abort" and free its blocks."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        if self._in_flight is not None and self._in_flight.deferred is not None:
            deferred = self.outputs.drop_deferred(self._in_flight.deferred, request_id)
            self._in_flight = self._in_flight._replace(deferred=deferred)
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        self.outputs.finished_on_arrival.discard(request_id)
        return self.outputs.collect({request_id})[0]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def requests(self) -> dict[str, list[Sequence]]:
        """Each request's sequences, until its finish is reported."""
        return self.outputs.requests

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutputDelta]:
        """One turn of the step loop (``step_loop``): the step function picked at start, handed
        what the last turn left in flight; the deltas it made."""
        in_flight, self._in_flight = self._in_flight, None  # a step that raises leaves nothing to replay
        deltas, self._in_flight = self._step_fn(in_flight)
        return deltas

    @property
    def on_early_outputs(self) -> Callable[[list[RequestOutputDelta]], None] | None:
        """Takes a step's deltas as soon as they are made (``OutputProcessor.on_early_outputs``)."""
        return self.outputs.on_early_outputs

    @on_early_outputs.setter
    def on_early_outputs(self, hook: Callable[[list[RequestOutputDelta]], None] | None) -> None:
        self.outputs.on_early_outputs = hook

    @property
    def num_steps(self) -> int:
        return self._parts.stats.num_steps

    @property
    def step_time_s(self) -> float:
        """Recent seconds per step that ran something (``StepStats``)."""
        return self._parts.stats.step_time_s

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
        sched, args, max_len = self.scheduler, self.args, self.model_config.max_model_len
        held = max_blocks_per_seq(max_len, args.block_size, self.kv.sliding_window,
                                  step_tokens(args.max_num_batched_tokens, args.num_scheduler_steps))
        return worker_load(sched.running, sched.waiting, self.kv.held_block_tables(), args.block_size, max_len,
                           args.max_num_batched_tokens, self.step_time_s, held)

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
            generation_tokens_total=self.outputs.generation_tokens_total,
        )

    def check_health(self) -> None:
        """Raise if a tensor-parallel rank died, even while the engine is idle."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
