"""The options of ``pagefleet bench``, named as ``vllm bench serve`` names them: each field is a
flag (``pagefleet.worker.options``), checked here once."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from pagefleet.cluster.bench.metrics import parse_goodput
from pagefleet.worker.options import check_choices, option

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}  # vLLM's backend names
DATASETS = ("random", "shared-prefix", "file")


@dataclass(slots=True)
class BenchArgs:
    base_url: str | None = option(None, help="server URL (default: http://HOST:PORT)")
    host: str = option("127.0.0.1", help="server host, without --base-url")
    port: int = option(8000, help="server port, without --base-url")
    endpoint: str = option("/v1/completions", choices=tuple(ENDPOINTS), help="the API to benchmark")
    model: str | None = option(None, help="model name to send (default: the server's first)")
    tokenizer: str | None = option(None, help="local tokenizer directory for building prompts (default: the "
                                              "model name, when it is a directory here, or pagefleet's demo "
                                              "checkpoint when the server serves it)")
    api_key: str | None = option(default_factory=lambda: os.environ.get("OPENAI_API_KEY")
                                 or os.environ.get("PAGEFLEET_API_KEY") or None, secret=True,
                                 help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY or "
                                      "$PAGEFLEET_API_KEY)")
    dataset: str = option("random", choices=DATASETS, aliases=("--dataset-name",), help="the prompts")
    dataset_path: str | None = option(None, help="for --dataset file: JSONL prompts or ShareGPT JSON")
    num_prompts: int | None = option(None, help="requests to send (default 1000; shared-prefix: tenants x "
                                                "questions per tenant)")
    random_input_len: int = option(1024, help="prompt tokens of --dataset random")
    random_output_len: int = option(128, help="max_tokens of --dataset random")
    random_range_ratio: float = option(0.0, help="lengths uniform on [L(1-r), L(1+r)], 0 <= r < 1")
    shared_prefix_num_tenants: int = option(10, help="tenants of --dataset shared-prefix")
    shared_prefix_questions_per_tenant: int | None = option(None, help="default: --num-prompts / tenants")
    shared_prefix_len: int = option(256, help="tokens each tenant's prompts share")
    shared_prefix_question_len: int = option(256, help="tokens of each question after the prefix")
    shared_prefix_output_len: int = option(128, help="max_tokens of --dataset shared-prefix")
    output_len: int | None = option(None, help="max_tokens of every request (overrides the dataset's)")
    request_rate: float = option(float("inf"), help="requests/s, Poisson arrivals (gamma with --burstiness); "
                                                    "inf: all at once")
    burstiness: float = option(1.0, help="gamma shape of the arrival gaps: < 1 burstier, > 1 more even")
    max_concurrency: int | None = option(None, help="requests in flight at most")
    ignore_eos: bool = option(False, help="generate max_tokens (always on for --dataset random)")
    temperature: float | None = option(None, help="sampling temperature (default: the server's)")
    seed: int = option(0, help="seed of the dataset and the arrival times")
    timeout: float = option(6 * 3600.0, help="seconds per request")
    percentiles: str = option("99", aliases=("--metric-percentiles",), help="comma-separated, e.g. 50,90,99")
    goodput: list[str] | None = option(None, nargs="+", parse=str, metavar="NAME:MS",
                                       help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    save_result: str | None = option(None, metavar="FILE.json", help="write the result with vLLM's keys")
    save_detailed: bool = option(False, help="add per-request lists to the result file")
    label: str | None = option(None, help="the result's label")
    plot: str | None = option(None, metavar="FILE.png", help="latency CDFs and throughput over time "
                                                              "(needs matplotlib: the `bench` extra)")
    disable_tqdm: bool = option(False, help="no progress bar")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be > 0")
        for name in ("max_concurrency", "num_prompts", "output_len", "shared_prefix_questions_per_tenant"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("random_input_len", "random_output_len", "shared_prefix_num_tenants", "shared_prefix_len",
                     "shared_prefix_question_len", "shared_prefix_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        self.percentile_list()
        self.goodput_slos()
        if self.dataset == "file" and not self.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        if self.plot and importlib.util.find_spec("matplotlib") is None:  # now, not after the run
            raise ValueError("--plot needs matplotlib: pip install 'pagefleet[bench]'")

    def percentile_list(self) -> list[float]:
        try:
            values = [float(p) for p in self.percentiles.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"--percentiles must be numbers, got {self.percentiles!r}") from None
        if not values or not all(0 <= p <= 100 for p in values):
            raise ValueError(f"--percentiles must be in [0, 100], got {self.percentiles!r}")
        return values

    def goodput_slos(self) -> dict[str, float] | None:
        return parse_goodput(self.goodput) if self.goodput else None
