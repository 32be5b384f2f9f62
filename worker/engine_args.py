"""Engine options, named as vLLM names them: each field is also a `pagefleet serve` flag and a
`serve.yaml` arg (see ``pagefleet.worker.options``), so an option is defined here once."""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.worker.core.request_queue import SCHEDULING_POLICIES
from pagefleet.worker.lora.request import LoRAModulePath, lora_modules_of, parse_lora_module
from pagefleet.worker.model_executor.model_config import QUANTIZATIONS, parse_dtype
from pagefleet.worker.options import check_choices, option, parse_bytes
from pagefleet.worker.request_check import (
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
)
from pagefleet.worker.simulated.presets import GPUS

BLOCK_SIZES = (8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CUDA_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64


def default_max_num_seqs(device: str, simulate: str | None) -> int:
    """max_num_seqs where none is given: vLLM's 256 for an engine on a CUDA device, else 64."""
    if simulate is None and device in ("cuda", "auto"):
        import torch

        if device == "cuda" or torch.cuda.is_available():
            return CUDA_MAX_NUM_SEQS
    return CPU_MAX_NUM_SEQS


@dataclass(slots=True)
class EngineArgs:
    model: str | None = option(None, help="Hugging Face checkpoint directory (`pagefleet serve` without one "
                                          "serves the built-in demo checkpoint, random weights)")
    served_model_name: list[str] | None = option(None, nargs="+", parse=str, metavar="NAME",
                                                 help="the model names clients may send; the first is the one "
                                                      "/v1/models lists first and responses report (default: the "
                                                      "checkpoint directory's name, with the --model argument as "
                                                      "given also accepted, as vLLM accepts it)")
    dtype: str = option("auto", help="weights and activations: auto (the checkpoint's), float32, bfloat16, "
                                     "float16 (aliases: half, fp16, bf16, float, fp32)")
    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="where the engine runs")
    block_size: int = option(16, choices=BLOCK_SIZES, help="tokens per KV cache block")
    max_num_seqs: int | None = option(None, help=f"sequences per engine step (default: {CUDA_MAX_NUM_SEQS} on a CUDA "
                                                 f"device, where a decode step of many sequences costs about what "
                                                 f"one costs; {CPU_MAX_NUM_SEQS} on CPU and a simulated GPU)")
    scheduling_policy: str = option("fcfs", choices=SCHEDULING_POLICIES,
                                    help="as vLLM's flag: fcfs serves waiting requests in arrival order and "
                                         "preempts the newest running one when KV blocks run out (a request's "
                                         "priority other than 0 is refused); priority serves them by the "
                                         "request's priority, lower first, then arrival, and preempts the "
                                         "running request of the highest priority value, latest arrival")
    max_num_batched_tokens: int = option(2048, help="tokens per engine step (long prompts are chunked)")
    max_model_len: int | None = option(None, help="context length (default: the model's)")
    kv_cache_bytes: int | None = option(None, parse=parse_bytes, metavar="BYTES",
                                        help="KV cache budget per TP rank, e.g. 512MiB or 2GiB "
                                             "(CPU default 512MiB; on CUDA it replaces --gpu-memory-utilization)")
    gpu_memory_utilization: float | None = option(None, help="fraction of GPU memory for weights, activations "
                                                             f"and KV cache (CUDA; default "
                                                             f"{DEFAULT_GPU_MEMORY_UTILIZATION})")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="KV cache storage, as vLLM's flag: auto (the model's dtype); fp8 (alias "
                                      "fp8_e4m3): float8 e4m3 with a scale per layer (1.0, as vLLM without "
                                      "calibrated scales), half the bytes of a 16-bit cache, so twice the blocks "
                                      "in the same budget. A CPU engine then runs attention in the PyTorch twin")
    enable_prefix_caching: bool = option(True, help="reuse the KV blocks of shared prompt prefixes")
    tensor_parallel_size: int = option(1, aliases=("-tp",), help="GPUs (ranks) per engine")
    seed: int = option(0, help="seed of the weights of load_format dummy and of unseeded sampling")
    load_format: str = option("safetensors", choices=("safetensors", "dummy"),
                              help="dummy: random weights from config.json alone, for sizing runs")
    log_stats_interval: float = option(10.0, metavar="SECONDS",
                                       help="seconds between engine stats lines (throughput, queue, KV usage, "
                                            "prefix hits) while busy; 0 turns them off")
    async_output_proc: bool | None = option(None, help="finish a step's outputs (detokenizing, stop strings, the "
                                                        "deltas) while the device runs the next step, as vLLM's async "
                                                        "output processing: a stop string then ends its sequence one "
                                                        "step late, the extra token dropped. Default: on where the "
                                                        "device computes asynchronously (CUDA, --simulate), off on "
                                                        "CPU")
    async_scheduling: bool | None = option(None, help="launch the next decode step while the device runs this "
                                                      "one, its input tokens read on the device, as vLLM's async "
                                                      "scheduling: the host's scheduling, sampling and bookkeeping "
                                                      "then overlap the device's work; waiting requests join "
                                                      "the step launched ahead. Applies while every sequence "
                                                      "of a step is decoding or ends its prompt; a sequence that "
                                                      "stops has "
                                                      "computed one token for nothing. Needs async output "
                                                      "processing, one rank, and no --num-scheduler-steps. "
                                                      "Default: on where async output processing is on and "
                                                      "those hold")
    num_scheduler_steps: int = option(1, metavar="N",
                                      help="decode steps per scheduling round (pagefleet's flag; vLLM's V0 engine "
                                           "had one of this name for multi-step scheduling, which V1 removed): "
                                           "the GPU runs N decode steps back to back, each fed the previous one's "
                                           "greedy tokens "
                                           "on the device, while the host checks the tokens already out (stops, "
                                           "text), so the GPU does not wait on the host between steps. Applies "
                                           "to rounds of plain greedy decoding on one GPU with CUDA graphs (no "
                                           "prompt in the step; no logprobs, penalties, grammar or min_tokens "
                                           "left); others run one step at a time. Tokens then arrive N at a "
                                           "time, and a sequence that stops mid-round has computed the rest "
                                           "for nothing")
    stream_interval: int = option(1, metavar="N",
                                  help="tokens per streamed delta, as vLLM's flag: a request's first and last "
                                       "tokens go out at once, the others once N have gathered, so the "
                                       "replica, the ingress and the HTTP stream handle fewer, larger deltas; "
                                       "clients see tokens in bursts of N")
    otlp_traces_endpoint: str | None = option(None, metavar="URL",
                                              help="export request spans to this OpenTelemetry collector "
                                                   "(OTLP; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL http/protobuf, "
                                                   "the default, or grpc), as vLLM's flag; off without it")
    trust_remote_code: bool = option(False, help="refused when true: pagefleet runs no code from a model "
                                                 "directory (its architectures are built in)")
    # Per-request limits on what the engine thread scans after every token.
    max_stop_strings: int = option(DEFAULT_MAX_STOP_STRINGS, help="stop strings per request")
    max_stop_string_chars: int = option(DEFAULT_MAX_STOP_STRING_CHARS, help="characters per stop string")
    max_stop_token_ids: int = option(DEFAULT_MAX_STOP_TOKEN_IDS, help="stop token ids per request")
    enforce_eager: bool = option(False, help="run the model eagerly, as vLLM's flag: no CUDA graphs, no compiled "
                                             "CPU kernels. Default: a one-rank CUDA engine captures its steps as "
                                             "CUDA graphs at start and replays them (docs/gpu_engine.md); a "
                                             "one-rank CPU engine compiles its C++ kernels at start (the decode "
                                             "attention reading KV blocks in place, norms, rotary; needs a C++ "
                                             "compiler, c++ or $CXX; one build per model shape serves every pool "
                                             "and batch size, cached across starts under "
                                             "~/.cache/pagefleet/cpu_kernels). Tensor-parallel engines run "
                                             "eagerly either way")
    quantization: str | None = option(None, choices=QUANTIZATIONS,
                                      help="fp8: FP8 (e4m3) weights, as vLLM's flag. A full-precision checkpoint's "
                                           "linear layers are quantized as they load, one scale per output "
                                           "channel, and activations per token at run time; embeddings and "
                                           "lm_head stay as they are. Halves the weights' memory. CUDA runs "
                                           "FP8 matmuls on the tensor cores (compute capability 8.9+: Ada, "
                                           "Hopper; older GPUs are refused); a CPU runs the PyTorch twin of the "
                                           "same math (slow, for tests). A pre-quantized FP8 checkpoint in the "
                                           "compressed-tensors layout loads as it is, with or without this flag")
    enable_lora: bool = option(False, help="serve LoRA adapters beside the base model, as vLLM's flag: a step "
                                           "batches requests for several adapters and the base model (PEFT "
                                           "checkpoints over q/k/v/o/gate/up/down projections; adapters shard "
                                           "over tensor-parallel ranks as their layers do). No CUDA graphs: "
                                           "the engine runs eagerly with it")
    max_loras: int = option(1, metavar="N", help="adapters in one step (GPU slots), as vLLM's flag: requests for "
                                                 "more wait until an adapter's requests end")
    max_lora_rank: int = option(16, metavar="R", help="the largest adapter rank served, as vLLM's flag; an "
                                                      "adapter of a higher rank is refused at load")
    max_cpu_loras: int | None = option(None, metavar="N",
                                       help="adapters kept loaded in host memory, least recently used evicted, "
                                            "as vLLM's flag (default and minimum: --max-loras)")
    lora_modules: list[LoRAModulePath] | None = option(None, nargs="+", parse=parse_lora_module,
                                                       metavar="NAME=PATH",
                                                       help="adapters served from the start, as vLLM's flag: "
                                                            "name=path, or JSON {\"name\": ..., \"path\": ..., "
                                                            "\"base_model_name\": ...}; needs --enable-lora")
    cpu_omp_threads: int | None = option(None, metavar="N",
                                         help="threads a one-rank CPU engine computes with (default: every "
                                              "core; a served engine computes at the lowest priority, so "
                                              "the server's threads still get a core at once. Sets torch's "
                                              "thread count for the whole process)")
    simulate: str | None = option(None, choices=tuple(GPUS), metavar="GPU",
                                  help="run no model: each engine step waits the time `pagefleet plan`'s roofline "
                                       f"gives its batch on this GPU ({', '.join(GPUS)}) over the real scheduler, "
                                       "KV block pool (sized from the GPU's memory as `pagefleet plan` sizes it), "
                                       "prefix cache, KV events and metrics; tokens are drawn from a seeded "
                                       "generator. --model may then be a model `pagefleet plan` knows by name "
                                       "(its config and the demo tokenizer serve). For capacity tests without "
                                       "GPUs: docs/simulator.md")
    simulate_efficiency: float = option(1.0, metavar="F",
                                        help="--simulate: the fraction of the roofline the simulated GPU reaches, "
                                             "in (0, 1]: a step takes the roofline's time / F (calibrations "
                                             "measured on an H200: docs/simulator.md)")

    @property
    def max_queued_seqs(self) -> int:
        """Twice ``max_num_seqs``: how much a worker replica holds, running or waiting in its
        engine, before more waits in Serve's router queue (where it can still go to another
        replica). The replica counts requests against it (its seats and Serve's
        ``max_ongoing_requests``, whatever a request's ``n``); the global scheduler counts
        sequences against it (a request of ``n`` holds ``n`` of a worker's seats there), so with
        ``n > 1`` the scheduler sees a worker full first."""
        return 2 * self.max_num_seqs

    def __post_init__(self) -> None:
        check_choices(self)
        self.dtype = parse_dtype(self.dtype)
        if isinstance(self.served_model_name, str):  # one name, as serve.yaml or a keyword may give it
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None:
            names = list(self.served_model_name)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError(f"served_model_name must be one or more non-empty names, got {names!r}")
            self.served_model_name = names
        if self.kv_cache_bytes is not None:
            self.kv_cache_bytes = parse_bytes(self.kv_cache_bytes)
        if self.max_num_seqs is None:
            self.max_num_seqs = default_max_num_seqs(self.device, self.simulate)
        if self.trust_remote_code:
            raise ValueError("trust_remote_code is not supported: pagefleet never runs code from a model "
                             "directory; it runs Llama, Mistral, Qwen2 and Qwen3 checkpoints with its own code")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "max_stop_strings",
                     "max_stop_string_chars", "max_stop_token_ids", "stream_interval", "num_scheduler_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self._check_lora()
        if self.cpu_omp_threads is not None and (not isinstance(self.cpu_omp_threads, int)
                                                 or isinstance(self.cpu_omp_threads, bool)
                                                 or self.cpu_omp_threads < 1):
            raise ValueError(f"cpu_omp_threads must be an integer >= 1, got {self.cpu_omp_threads!r}")
        if self.log_stats_interval < 0:
            raise ValueError(f"log_stats_interval must be >= 0 (0 turns the stats line off), got "
                             f"{self.log_stats_interval}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.simulate_efficiency <= 1.0:
            raise ValueError(f"simulate_efficiency must be in (0, 1], got {self.simulate_efficiency}")
        if self.gpu_memory_utilization is not None:
            if self.kv_cache_bytes is not None:
                raise ValueError("give kv_cache_bytes or gpu_memory_utilization, not both")
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_lora(self) -> None:
        self.lora_modules = lora_modules_of(self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or isinstance(self.max_cpu_loras, bool)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras!r}")
