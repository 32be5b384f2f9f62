"""What ``pagefleet bench`` prints and saves: vLLM's report layout and its result-file keys."""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.cluster.bench.metrics import BenchMetrics, RequestResult

HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass(frozen=True, slots=True)
class RunConfig:
    """The run's settings as they go into the result file."""

    backend: str  # "openai" or "openai-chat", as vLLM names the endpoint types
    label: str | None
    model_id: str
    tokenizer_id: str | None
    dataset: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    date: str


def _p_name(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_report(m: BenchMetrics, cfg: RunConfig, results: list[RequestResult], max_errors: int = 5) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value, fmt: str = "") -> None:
        lines.append(f"{name:<40} {value:{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if cfg.max_concurrency is not None:
        row("Maximum request concurrency:", cfg.max_concurrency)
    if cfg.request_rate != float("inf"):
        row("Request rate configured (RPS):", cfg.request_rate, ".2f")
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Cached prompt tokens (share):", f"{m.cached_tokens} ({100 * m.cached_token_share:.1f}%)")
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Input token throughput (tok/s):", m.input_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    if m.client_cpu_ms_per_token is not None:
        row("Client CPU per output token (ms):", m.client_cpu_ms_per_token, ".3f")
    for key, (short, header) in HEADERS.items():
        s = m.ms[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", s.mean, ".2f")
        row(f"Median {short} (ms):", s.median, ".2f")
        for p, value in s.percentiles.items():
            row(f"P{_p_name(p)} {short} (ms):", value, ".2f")
    failed = [r.error for r in results if not r.success]
    if failed:
        lines.append("{s:{c}^{n}}".format(s="Failed Requests", n=50, c="-"))
        for i, error in enumerate(failed[:max_errors]):
            lines.append(f"Error {i}: {error.splitlines()[0] if error else '(no message)'}")
        if len(failed) > max_errors:
            lines.append(f"... and {len(failed) - max_errors} more")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_dict(m: BenchMetrics, cfg: RunConfig, results: list[RequestResult], detailed: bool) -> dict:
    """The result file, with vLLM's key names (``vllm bench serve --save-result``) and a few
    of pagefleet's own (``dataset``, ``total_cached_tokens``, ``cached_token_share``,
    ``input_throughput``, ``client_cpu_s``)."""
    out = {
        "date": cfg.date, "endpoint_type": cfg.backend, "backend": cfg.backend, "label": cfg.label,
        "model_id": cfg.model_id, "tokenizer_id": cfg.tokenizer_id, "dataset": cfg.dataset,
        "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "total_cached_tokens": m.cached_tokens, "cached_token_share": m.cached_token_share,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "input_throughput": m.input_throughput, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
    }
    if m.client_cpu_s is not None:
        out["client_cpu_s"] = m.client_cpu_s
    for key, s in m.ms.items():
        out[f"mean_{key}_ms"] = s.mean
        out[f"median_{key}_ms"] = s.median
        out[f"std_{key}_ms"] = s.std
        for p, value in s.percentiles.items():
            out[f"p{_p_name(p)}_{key}_ms"] = value
    if detailed:
        out.update({
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
        })
    return out
