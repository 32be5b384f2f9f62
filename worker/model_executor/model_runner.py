"""Turns a scheduled step into tensors, runs the model over the paged cache, returns logits."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from pagefleet.kernels.ops import AttentionPlanner, AttentionSpec, no_plan
from pagefleet.worker.core.kv_cache_sizing import DEFAULT_CPU_KV_CACHE_BYTES, gpu_kv_budget, kv_bytes_per_block
from pagefleet.worker.engine_args import DEFAULT_GPU_MEMORY_UTILIZATION
from pagefleet.worker.lora.manager import LoRAManager
from pagefleet.worker.lora.request import LoRAConfig, LoRARequest
from pagefleet.worker.model_executor.cuda_graphs import DecodeGraphs, PrefillGraphs, StepGraphs, capture_graphs
from pagefleet.worker.model_executor.loader import load_model
from pagefleet.worker.model_executor.model import AttentionMetadata
from pagefleet.worker.model_executor.model_config import ModelConfig, kv_cache_torch_dtype
from pagefleet.worker.model_executor.platform import platform_for
from pagefleet.worker.model_executor.quantization import resolve_quantization
from pagefleet.worker.model_executor.step_buffers import StepBuffers, take_prev_tokens
from pagefleet.worker.model_executor.step_input import StepInput, profile_step
from pagefleet.worker.parallel.tp_group import TPGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, tp: TPGroup, device: torch.device, load_format: str = "safetensors",
                 seed: int = 0, enforce_eager: bool = False, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, kv_cache_dtype: str = "auto",
                 quantization: str | None = None, lora: LoRAConfig | None = None) -> None:
        """enforce_eager: True keeps the platform from compiling kernels of its own (on CPU the
        C++ decode attention, norms and rotary; on CUDA the graphs): the backend's kernels
        serve, launched one by one. max_num_seqs, max_num_batched_tokens: the engine's step limits,
        which size the step buffers and the graphs. kv_cache_dtype: ``EngineArgs.kv_cache_dtype``
        (auto: the model's dtype; fp8: e4m3). quantization: ``EngineArgs.quantization`` (a
        checkpoint stored in FP8 runs FP8 without it). lora: the LoRA slots and limits where LoRA is
        enabled (``lora_manager`` then holds the adapters)."""
        self.cfg = cfg
        self.tp = tp
        self.device = device
        self.enforce_eager = enforce_eager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.platform = platform_for(device)
        self.platform.prepare_process()
        # Decided once, here: a bad PAGEFLEET_KERNELS stops the start instead of failing every step.
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, cfg.dtype)
        self.kernels = self.platform.select_kernels(device, enforce_eager, self.kv_cache_dtype)
        logger.info("kernels on %s: %s", device, self.kernels)
        quantization = resolve_quantization(quantization, cfg, device)  # refuses a GPU without FP8 before loading
        self.model = load_model(cfg, tp, self.kernels, device, load_format, seed, quantization)
        self.lora_manager = None if lora is None else LoRAManager(self.model, lora.max_loras, lora.max_lora_rank,
                                                                   lora.max_cpu_loras, device)
        self.platform.prepare_model(self.model, self.kernels)
        attn = self.model.layers[0].self_attn
        self.num_kv_heads = attn.num_kv_heads
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The kernels' step planner, made for the KV cache's shape once it is allocated.
        self.plan_attention: AttentionPlanner = no_plan
        # CUDA: every step's indices go over in one copy (step_buffers.py); CPU builds them in place.
        self.buffers: StepBuffers | None = None
        self.graphs: StepGraphs | None = None  # set by use_graphs

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return None if self.graphs is None else self.graphs.decode

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        return None if self.graphs is None else self.graphs.prefill

    @property
    def compiled_kernels(self) -> bool:
        """Whether the platform compiled kernels of its own in place of the backend's."""
        return bool(self.kernels.compiled)

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return kv_bytes_per_block(self.cfg.num_layers, self.num_kv_heads, self.cfg.head_dim, elem, block_size)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def available_kv_bytes(self, kv_cache_bytes: int | None, gpu_memory_utilization: float | None,
                           max_num_batched_tokens: int) -> int:
        """CPU: the byte budget. CUDA: free memory after a profile run of the largest step,
        times the utilization fraction, like vLLM."""
        if self.device.type != "cuda":
            return kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_bytes:
            return kv_cache_bytes
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.graphs_wanted:
            # The graphs keep a memory pool of their own for good, as large as the largest
            # graph's step: the largest prefill (measured above) or one decode step of the
            # largest batch, measured the same way. It is set aside beside the peak.
            prefill = peak - base
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profile_run(self.max_num_seqs, decode=True)
            torch.cuda.synchronize(self.device)
            peak += max(prefill, torch.cuda.max_memory_allocated(self.device) - base)
        fraction = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
        return gpu_kv_budget(total, fraction, peak)

    @property
    def graphs_wanted(self) -> bool:
        """Steps run as CUDA graphs: on CUDA, one rank, unless enforce_eager, for dense models
        only (the MoE twin reads each layer's expert counts on the host, which a graph cannot) and
        without LoRA (its PyTorch path groups rows by adapter on the host)."""
        return (self.device.type == "cuda" and self.tp.size == 1 and not self.enforce_eager
                and not self.cfg.num_experts and self.lora_manager is None)

    def _profile_run(self, num_tokens: int, decode: bool = False) -> None:
        # One sequence of num_tokens (decode: num_tokens sequences of one token each, every
        # row sampled) over a scratch cache big enough to hold it.
        bs = 16
        nblocks = -(-num_tokens // bs)
        caches = [(torch.zeros(nblocks, bs, self.num_kv_heads, self.cfg.head_dim, dtype=self.kv_cache_dtype,
                               device=self.device),) * 2 for _ in range(self.cfg.num_layers)]
        step = profile_step(num_tokens, bs, decode)
        saved, self.kv_caches = self.kv_caches, caches
        try:
            self.execute(step)
        finally:
            self.kv_caches = saved
            del caches

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.cfg.head_dim)
        # Zeroed, not empty: unused slots of a partly filled block are read (and masked),
        # and NaN garbage would survive the mask as 0 * NaN.
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                          for _ in range(self.cfg.num_layers)]
        attn = self.model.layers[0].self_attn
        spec = AttentionSpec(self.kv_cache_dtype, attn.num_heads, attn.num_kv_heads, self.cfg.head_dim, block_size)
        self.plan_attention = self.kernels.attention_planner(spec)  # may build a kernel: at start, not on a request
        if self.device.type == "cuda":
            self.buffers = self._step_buffers(block_size)
            if self.graphs_wanted:
                self.use_graphs(capture=True)

    def _step_buffers(self, block_size: int) -> StepBuffers:
        max_blocks = -(-self.cfg.max_model_len // block_size)
        return StepBuffers(self.max_num_batched_tokens, self.max_num_seqs, max_blocks, self.device)

    def use_graphs(self, capture: bool) -> None:
        """Run every step over the static step buffers, replayed as CUDA graphs (``capture``) or
        eagerly (the CPU tests' way of checking that path against the ordinary one)."""
        if self.plan_attention is not no_plan:
            raise ValueError(f"graphs need kernels that plan nothing on the host, not {self.kernels}")
        if self.buffers is None:
            self.buffers = self._step_buffers(self.kv_caches[0][0].shape[1])
        decode = DecodeGraphs(self.model, self.kv_caches, self.buffers, self.max_num_seqs, self.cfg.vocab_size, capture)
        prefill = PrefillGraphs(self.model, self.kv_caches, self.buffers, self.max_num_seqs, self.cfg.hidden_size,
                                capture)
        self.graphs = StepGraphs(decode, prefill)
        if capture:
            capture_graphs([prefill, decode], torch.cuda.graph_pool_handle())

    def _tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        dev = self.device
        width = max(len(t) for t in step.block_tables)
        padded = [row + [0] * (width - len(row)) for row in step.block_tables]
        block_table = torch.tensor(padded, dtype=torch.int32, device=dev)
        seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=dev),
            block_table=block_table,
            query_start_loc=torch.tensor(step.query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=seq_lens,
            attn_plan=self.plan_attention(block_table, seq_lens, step.query_start_loc, step.seq_lens),
        )
        return (torch.tensor(step.input_ids, dtype=torch.int64, device=dev),
                torch.tensor(step.positions, dtype=torch.int64, device=dev), meta,
                torch.tensor(step.logits_indices, dtype=torch.int64, device=dev))

    def _eager_tensors(self, step: StepInput, prev_tokens: torch.Tensor | None):
        """The tensors an eager forward reads: the step buffers' views where the step fits them."""
        buffers = self.buffers
        if buffers is not None and buffers.fits(step):
            tensors = buffers.tensors(step, self.plan_attention)
            buffers.take_prev_tokens(step, prev_tokens)
            return tensors
        tensors = self._tensors(step)
        if step.prev_token_rows:
            rows = torch.tensor(step.prev_token_rows, dtype=torch.int64, device=self.device)
            take_prev_tokens(tensors[0], rows, prev_tokens)
        return tensors

    def decode_greedy(self, steps: list[StepInput]) -> Iterator[list[int]] | None:
        """Run ``steps`` (one window of decode steps over the same sequences, ``DecodeGraphs.run_greedy``)
        and yield each one's greedy tokens; None where this runner cannot (no decode graph for it)."""
        run = None if self.graphs is None else self.graphs.pick(steps[0])
        if run is None or run.graphs is not self.graphs.decode:
            return None
        return run.graphs.run_greedy(steps, run.size)

    @torch.inference_mode()
    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward one step; [S, vocab] fp32 logits of the sampling rows on rank 0, else None.

        ``prev_tokens``: the previous step's sampled tokens, still on the device ([S], the sampler's
        ``Drawn.tokens``), which the step's first tokens take (``StepInput.prev_token_rows``). So a
        step can be launched before the host has the tokens it reads (async scheduling)."""
        run = None if self.graphs is None else self.graphs.pick(step)
        if run is not None:
            return run.graphs.run(step, run.size, prev_tokens)
        input_ids, positions, meta, logits_indices = self._eager_tensors(step, prev_tokens)
        if step.lora_ids:
            mapping = self._lora().mapping(step.lora_ids, step.query_start_loc)
            with self.lora_manager.batch.step(mapping):
                hidden = self.model(input_ids, positions, meta, self.kv_caches)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden.index_select(0, logits_indices))

    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("a step names LoRA adapters, but LoRA is not enabled (enable_lora)")
        return self.lora_manager

    def add_lora(self, request: LoRARequest) -> None:
        """Register and load a LoRA adapter (``LoRAManager.add_lora``)."""
        self._lora().add_lora(request)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora().remove_lora(lora_int_id)
