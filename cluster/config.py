"""The options of ``pagefleet serve`` and of the Serve app builder.

Engine options are ``EngineArgs``' fields; what is not the engine's (HTTP,
replica counts, Ray resources, the API key) are ``ServeArgs``' fields. Both
declare each option once (``pagefleet.worker.options``): the CLI flags, the
``args:`` of ``deploy/serve.yaml`` and ``build_app``'s dict all come from those
fields, with the same names (vLLM's, with underscores) and defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from pagefleet.router.openai.http_guards import DEFAULT_MAX_BODY_BYTES
from pagefleet.router.openai.output.reasoning import PARSERS as REASONING_PARSERS
from pagefleet.router.openai.preprocess import (
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_REQUEST_ID_CHARS,
)
from pagefleet.router.openai.request_size import DEFAULT_MAX_UNSTREAMED_RESPONSE_TOKENS
from pagefleet.router.openai.tool_parsers import TOOL_PARSERS
from pagefleet.router.routing.kv_routing import KVRoutingOptions
from pagefleet.router.routing.policies import POLICIES
from pagefleet.worker.cpu.threads import cpu_compute_threads
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.options import check_choices, from_namespace, option, parse_bytes, split_mapping
from pagefleet.worker.replica.autoscaling import (
    AUTOSCALING_POLICIES,
    default_target_ongoing_requests,
    worker_autoscaling_config,
)

API_KEY_ENV = "PAGEFLEET_API_KEY"


def read_api_key_file(path: str) -> str:
    """The first line of ``path``, stripped; ValueError for a file that holds no key."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path!r}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {path!r} holds no key on its first line")
    return key


class WorkerRange(NamedTuple):
    min_replicas: int
    max_replicas: int


def parse_workers(value: int | str) -> int | str:
    """``3`` or ``"3"`` -> 3; ``"1:4"`` -> ``"1:4"`` (checked: 1 <= MIN <= MAX; ``"2:2"`` -> 2)."""
    if isinstance(value, bool):
        raise ValueError(f"workers must be N or MIN:MAX, got {value!r}")
    text = str(value).strip()
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"workers must be N or MIN:MAX with whole numbers, got {value!r}")
    low, high = int(parts[0]), int(parts[-1])
    if len(parts) == 1 and low < 1:
        raise ValueError(f"workers must be an integer >= 1, got {low}")
    if low < 1 or high < low:
        raise ValueError(f"workers MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    return low if low == high else f"{low}:{high}"


def _workers_flag(text: str) -> int | str:
    """The flag's text as serve.yaml would give it (checked with the rest: ``parse_workers``)."""
    return int(text) if text.strip().isdigit() else text


@dataclass(slots=True)
class ServeArgs:
    host: str = option("127.0.0.1", help="HTTP bind address (default: loopback only)")
    port: int = option(8000, help="HTTP port")
    # An int, or "MIN:MAX" where the replicas autoscale (``worker_range``).
    workers: int = option(1, parse=_workers_flag, metavar="N|MIN:MAX",
                          help="engine replicas, each one TP group: N, or MIN:MAX for Ray Serve to scale "
                               "between on the requests in each replica's engine (docs/scaling.md)")
    target_ongoing_requests: float | None = option(None, help="workers MIN:MAX: the requests per replica the "
                                                              "autoscaler keeps each replica near (default: 3/4 of "
                                                              "max_num_seqs, rounded up)")
    upscale_delay_s: float = option(30.0, help="workers MIN:MAX: how long the load must call for more replicas "
                                               "before they start (Ray Serve's default)")
    downscale_delay_s: float = option(600.0, help="workers MIN:MAX: how long the load must allow fewer replicas "
                                                  "before one stops (Ray Serve's default)")
    autoscaling_policy: str = option(
        "requests", choices=tuple(AUTOSCALING_POLICIES),
        help="workers MIN:MAX: what Ray Serve scales on: 'requests' (the requests in each replica over "
             "target_ongoing_requests) or 'kv' (that, or the KV blocks the running sequences hold where "
             "that calls for more: docs/scaling.md)")
    autoscaling_config: dict | None = option(None, parse=json.loads, metavar="JSON",
                                             help="workers MIN:MAX: more of Ray Serve's autoscaling_config keys "
                                                  "(look_back_period_s, metrics_interval_s, upscaling_factor, "
                                                  "downscaling_factor, ...), as a JSON object")
    api_key: str | None = option(default_factory=lambda: os.environ.get(API_KEY_ENV) or None, secret=True,
                                 help="require 'Authorization: Bearer KEY' on every route but /health, /metrics "
                                      f"and /version (default: ${API_KEY_ENV}; on the command line every local "
                                      "user sees it in ps: prefer the variable or --api-key-file)")
    api_key_file: str | None = option(None, metavar="PATH", help="read the API key from this file (its first "
                                                                 "line), in place of --api-key")
    # Ray resources. worker_num_gpus None: one GPU per TP rank when the cluster has GPUs, else none.
    worker_num_cpus: float = option(1.0, aliases=("--worker-cpus",), help="Ray CPUs reserved per TP rank")
    worker_num_gpus: float | None = option(None, help="Ray GPUs per TP rank (default: 1 on a cluster with "
                                                      "GPUs, else 0)")
    ingress_num_cpus: float = option(0.5, help="Ray CPUs reserved per ingress replica")
    ingress_replicas: int = option(1, help="replicas of the OpenAI ingress")
    routing: str = option("kv", choices=POLICIES,
                          help="how requests pick a worker: kv (the global scheduler's view of every worker's KV "
                               "blocks: cached prefix, load and room, with admission control), least_loaded, pow2 "
                               "(power of two choices), round_robin, prefix (a router-local guess of the caches), "
                               "ray_prefix (Ray Serve LLM's PrefixCacheAffinityRouter)")
    routing_cost_weight: float = option(4.0, help="kv: cost of one prompt block a worker must compute, against one "
                                                  "block of load it already holds (higher: follow cached prefixes "
                                                  "harder)")
    admission_queue_size: int = option(64, help="requests each ingress replica holds waiting for room (kv: a worker "
                                                "whose free KV blocks take them, FIFO; other policies: a free slot "
                                                "on a worker replica, in Serve's queue); beyond it, 429 with "
                                                "Retry-After at once. 0: no bound (kv: no admission control)")
    admission_max_wait_s: float = option(2.0, help="kv: longest wait in the admission queue before a 429")
    routing_max_staleness_s: float = option(1.0, help="kv: oldest copy of the global scheduler's view an ingress "
                                                      "routes with; past it, requests are routed by load (counted "
                                                      "as fallbacks), still through admission control")
    # What one request may hold, refused at the ingress before any work (the engine's own limits
    # are engine options).
    max_request_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, parse=parse_bytes, metavar="BYTES",
                                         help="largest request body; larger ones get 413")
    max_prompts_per_request: int = option(DEFAULT_MAX_PROMPTS, help="prompts in one /v1/completions request, "
                                                                    "and sequences in one request (prompts x n)")
    max_chat_messages: int = option(DEFAULT_MAX_CHAT_MESSAGES, help="messages in one chat request")
    max_prompt_chars: int | None = option(None, help="characters of prompt text read before tokenizing "
                                                     "(default: max_model_len x the tokenizer's longest "
                                                     "token, so no prompt that fits is refused)")
    max_request_id_chars: int = option(DEFAULT_MAX_REQUEST_ID_CHARS, help="length of a client's request_id")
    max_unstreamed_response_tokens: int = option(DEFAULT_MAX_UNSTREAMED_RESPONSE_TOKENS,
                                                 help="tokens and top logprobs one non-streamed response may hold: "
                                                      "n x max_tokens x (1 + top_logprobs), max_tokens filled in "
                                                      "to the context where not given; larger requests get 400 "
                                                      "(streamed ones are not bounded)")
    tool_call_parser: str | None = option(None, choices=tuple(TOOL_PARSERS),
                                          help="how the model writes tool calls, for tool_choice 'auto' (hermes: "
                                               "Qwen2.5, Qwen3 and the demo model; llama3_json: Llama 3.1/3.2; "
                                               "mistral)")
    reasoning_parser: str | None = option(None, choices=tuple(REASONING_PARSERS),
                                          help="put what a reasoning model writes inside <think>...</think> in "
                                               "reasoning_content, apart from content (qwen3; deepseek_r1, whose "
                                               "template opens the block in the prompt)")
    enable_auto_tool_choice: bool = option(False, help="let requests with tools use tool_choice 'auto' (the "
                                                       "model decides; its output is parsed with "
                                                       "--tool-call-parser)")
    allow_runtime_lora_updating: bool = option(False, help="serve POST /v1/load_lora_adapter and "
                                                           "/v1/unload_lora_adapter (vLLM's "
                                                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind the API key "
                                                           "like every /v1 route); needs --enable-lora")
    drain_timeout_s: float = option(30.0, help="how long the requests in flight may finish when pagefleet serve "
                                               "stops (SIGTERM, Ctrl-C; new ones get 503) and when Serve stops a "
                                               "replica (an upgrade, a scale-down)")

    @property
    def worker_range(self) -> WorkerRange:
        """The fewest and most worker replicas (the same for a fixed count)."""
        if isinstance(self.workers, int):
            return WorkerRange(self.workers, self.workers)
        low, high = self.workers.split(":")
        return WorkerRange(int(low), int(high))

    @property
    def autoscales(self) -> bool:
        low, high = self.worker_range
        return low != high

    def key(self) -> str | None:
        """The API key the server requires: the first line of ``api_key_file`` when given (read where
        the app is built: the file may exist only on the node that builds it), else ``api_key``."""
        return read_api_key_file(self.api_key_file) if self.api_key_file is not None else self.api_key

    def __post_init__(self) -> None:
        check_choices(self)
        if self.routing_cost_weight < 0:
            raise ValueError(f"routing_cost_weight must be >= 0, got {self.routing_cost_weight}")
        if self.admission_queue_size < 0 or isinstance(self.admission_queue_size, bool):
            raise ValueError(f"admission_queue_size must be an integer >= 0, got {self.admission_queue_size!r}")
        if self.admission_max_wait_s <= 0 or self.routing_max_staleness_s <= 0:
            raise ValueError("admission_max_wait_s and routing_max_staleness_s must be > 0")
        self.max_request_body_bytes = parse_bytes(self.max_request_body_bytes)
        self.workers = parse_workers(self.workers)
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, dict):
            raise ValueError(f"autoscaling_config must be a mapping, got {self.autoscaling_config!r}")
        for name in ("ingress_replicas", "max_prompts_per_request", "max_request_id_chars",
                     "max_chat_messages", "max_unstreamed_response_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        if self.worker_num_cpus < 0 or self.ingress_num_cpus < 0 or (self.worker_num_gpus or 0) < 0:
            raise ValueError("CPU and GPU counts must be >= 0")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass(slots=True)
class ServeOptions:
    """Everything ``build_app`` needs: the engine's options and the serving ones."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    serve: ServeArgs = field(default_factory=ServeArgs)

    def __post_init__(self) -> None:
        if self.serve.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora")

    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> "ServeOptions":
        """From one flat dict (serve.yaml ``args:``, ``build_app``'s argument)."""
        engine, serve = split_mapping(dict(args or {}), EngineArgs, ServeArgs)
        return cls(EngineArgs(**engine), ServeArgs(**serve))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "ServeOptions":
        return cls(from_namespace(EngineArgs, namespace), from_namespace(ServeArgs, namespace))

    def kv_routing(self) -> KVRoutingOptions:
        serve = self.serve
        return KVRoutingOptions(cost_weight=serve.routing_cost_weight, admission_queue_size=serve.admission_queue_size,
                                admission_max_wait_s=serve.admission_max_wait_s,
                                max_staleness_s=serve.routing_max_staleness_s)

    def worker_autoscaling_config(self) -> dict[str, Any] | None:
        """Serve's ``autoscaling_config`` for the workers; None for a fixed count."""
        serve = self.serve
        if not serve.autoscales:
            return None
        low, high = serve.worker_range
        target = serve.target_ongoing_requests or default_target_ongoing_requests(self.engine.max_num_seqs)
        return worker_autoscaling_config(low, high, target, serve.upscale_delay_s, serve.downscale_delay_s,
                                         serve.autoscaling_config, serve.autoscaling_policy)

    def engine_args_for_this_machine(self, cores: int) -> EngineArgs:
        """The engine options each worker replica gets: ``cpu_omp_threads`` left unset becomes
        this machine's share for one engine rank (``cpu_compute_threads`` over every rank of the
        app), so replicas sharing a node do not oversubscribe its cores."""
        engine = self.engine
        if engine.cpu_omp_threads is not None:
            return engine
        ranks = self.serve.worker_range.max_replicas * engine.tensor_parallel_size
        return dataclasses.replace(engine, cpu_omp_threads=cpu_compute_threads(None, cores, ranks))

    def logical_cpus_needed(self) -> float:
        """CPUs the app reserves on a Ray cluster (Serve's controller and proxy take none)."""
        serve = self.serve
        return serve.worker_range.max_replicas * self.engine.tensor_parallel_size * serve.worker_num_cpus + \
            serve.ingress_replicas * serve.ingress_num_cpus
