"""The numbers of ``pagefleet bench``, from per-request timings. Pure (no I/O).

Definitions are vLLM's (``vllm bench serve``), so results compare one to one:

- TTFT: from sending the request to the first chunk that carries generated tokens.
- ITL: the gap before each later token chunk, one value per chunk (a chunk holding several
  tokens is one gap).
- TPOT: (E2EL - TTFT) / (output tokens - 1) per request with more than one output token: the
  first token excluded.
- E2EL: from sending the request to its last token chunk.
- Output tokens: the server's ``usage.completion_tokens`` (else the client's count).
- Goodput: completed requests per second whose TTFT, TPOT (0 for one-token outputs) and E2EL
  all meet their SLOs.

Percentiles interpolate linearly between closest ranks (numpy's default); std is the
population standard deviation. Empty samples give 0.0, as vLLM reports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (seconds on the client's monotonic clock)."""

    success: bool = False
    prompt_len: int = 0         # the server's usage.prompt_tokens when it sent usage
    output_tokens: int = 0
    cached_tokens: int = 0      # usage.prompt_tokens_details.cached_tokens
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0        # E2EL
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Summary:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile -> value


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    cached_tokens: int
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ms: dict[str, Summary]  # "ttft", "tpot", "itl", "e2el" -> summary in milliseconds
    # The client's own CPU time over the run (every thread of its process), where it was taken:
    # on a machine the client shares with the server, the cores the server did not get.
    client_cpu_s: float | None = None

    @property
    def cached_token_share(self) -> float:
        return self.cached_tokens / self.total_input if self.total_input else 0.0

    @property
    def client_cpu_ms_per_token(self) -> float | None:
        """None where the client's CPU time was not taken or no token came."""
        if self.client_cpu_s is None or not self.total_output:
            return None
        return 1000 * self.client_cpu_s / self.total_output


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks; ``sorted_values`` ascending, non-empty."""
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(values_s: list[float], percentiles: list[float]) -> Summary:
    """Seconds in, milliseconds out."""
    if not values_s:
        return Summary(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    xs = sorted(v * 1000 for v in values_s)
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return Summary(mean, percentile(xs, 50), std, {p: percentile(xs, p) for p in percentiles})


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def token_times(r: RequestResult) -> list[float]:
    """When each token chunk arrived (absolute client time)."""
    t = r.start_time + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def tokens_per_second(results: list[RequestResult], width: float = 1.0) -> list[float]:
    """Output token chunks per second in consecutive bins of ``width`` seconds from the first send."""
    ok = [r for r in results if r.success]
    if not ok:
        return []
    t0 = min(r.start_time for r in ok)
    bins = [0] * (int((max(r.start_time + r.latency for r in ok) - t0) / width) + 1)
    for r in ok:
        for t in token_times(r):
            bins[min(int((t - t0) / width), len(bins) - 1)] += 1
    return [count / width for count in bins]


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once, over half-open intervals [start, end)."""
    events = sorted([(r.start_time, 1) for r in results if r.success]
                    + [(r.start_time + r.latency, -1) for r in results if r.success])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    goodput_slos_ms: dict[str, float] | None = None, client_cpu_s: float | None = None) -> BenchMetrics:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    good = None
    if goodput_slos_ms:
        good = sum(1 for r in ok if _meets(r, goodput_slos_ms)) / duration
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_second = tokens_per_second(results)  # vLLM's peak: the busiest whole second
    return BenchMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration, total_input=total_in,
        total_output=total_out, cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) / duration, request_goodput=good, input_throughput=total_in / duration,
        output_throughput=total_out / duration, total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=float(max(per_second, default=0)), max_concurrent_requests=peak_concurrency(results),
        ms={name: summarize(values, percentiles)
            for name, values in zip(METRICS, (ttfts, tpots, itls, e2els))},
        client_cpu_s=client_cpu_s)


def _meets(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(values[name] * 1000 <= limit for name, limit in slos_ms.items())


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad goodput SLO {pair!r}: use NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad goodput SLO {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"bad goodput SLO {pair!r}: milliseconds must be >= 0")
    return slos
