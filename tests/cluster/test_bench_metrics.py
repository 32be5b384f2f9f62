"""``pagefleet bench``'s numbers from hand-built timings, its report and result keys (pure)."""

from __future__ import annotations

import pytest

from pagefleet.cluster.bench.metrics import (
    RequestResult,
    compute_metrics,
    parse_goodput,
    peak_concurrency,
    percentile,
    summarize,
    tokens_per_second,
)
from pagefleet.cluster.bench.report import RunConfig, format_report, result_dict


def result(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10, cached: int = 0) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_tokens=tokens, cached_tokens=cached,
                         start_time=start, ttft=ttft, itl=itl, latency=ttft + sum(itl))


def test_percentiles_interpolate_between_closest_ranks():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97 x (4 - 3)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    s = summarize([0.001, 0.002, 0.003, 0.004], [90])
    assert (s.mean, s.median, s.percentiles[90]) == pytest.approx((2.5, 2.5, 3.7))
    assert s.std == pytest.approx((1.25) ** 0.5)  # population std of 1, 2, 3, 4 ms
    assert summarize([], [99]).percentiles == {99: 0.0}


def test_ttft_tpot_itl_e2el_as_vllm_defines_them():
    # A: first token at 0.2 s, then chunks 0.02 s apart, 5 tokens over 4 chunks (one chunk held two)
    a = result(0.0, 0.2, [0.02, 0.02, 0.04], tokens=5)
    # B: one output token: no TPOT, no ITL
    b = result(0.5, 0.1, [], tokens=1)
    failed = RequestResult(success=False, error="HTTP 500: boom", start_time=0.1)
    m = compute_metrics([a, b, failed], duration=2.0, percentiles=[50])
    assert (m.completed, m.failed) == (2, 1)
    assert m.ms["ttft"].mean == pytest.approx(150.0)
    # TPOT excludes the first token: (E2EL - TTFT) / (tokens - 1) = 0.08 / 4
    assert m.ms["tpot"].mean == pytest.approx(20.0) and m.ms["tpot"].median == pytest.approx(20.0)
    # ITL: one value per chunk after the first
    assert m.ms["itl"].mean == pytest.approx(80 / 3)
    assert m.ms["itl"].median == pytest.approx(20.0)
    assert m.ms["e2el"].mean == pytest.approx((280 + 100) / 2)
    assert (m.total_input, m.total_output) == (20, 6)
    assert m.request_throughput == 1.0 and m.output_throughput == 3.0 and m.input_throughput == 10.0
    assert m.total_token_throughput == 13.0
    assert m.request_goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    fast = result(0.0, 0.1, [0.01] * 9, tokens=10)       # TPOT 10 ms
    slow_start = result(0.0, 0.6, [0.01] * 9, tokens=10)  # TTFT 600 ms
    slow_decode = result(0.0, 0.1, [0.05] * 9, tokens=10)  # TPOT 50 ms
    one_token = result(0.0, 0.2, [], tokens=1)           # TPOT counts as 0
    m = compute_metrics([fast, slow_start, slow_decode, one_token], 2.0, [99], parse_goodput(["ttft:500", "tpot:20"]))
    assert m.request_goodput == 2 / 2.0
    assert parse_goodput(["ttft:1", "e2el:2.5"]) == {"ttft": 1.0, "e2el": 2.5}
    for bad in (["itl:3"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="bad goodput SLO"):
            parse_goodput(bad)


def test_peak_concurrency_and_tokens_per_second():
    a = result(0.0, 0.5, [0.25, 0.25], tokens=3)  # [0, 1.0): chunks at 0.5, 0.75, 1.0
    b = result(1.0, 0.2, [0.3], tokens=2)         # [1.0, 1.5): starts as a ends
    c = result(0.2, 0.1, [], tokens=1)            # [0.2, 0.3)
    assert peak_concurrency([a, b, c]) == 2
    assert tokens_per_second([a, b, c]) == [3.0, 3.0]  # 0.3, 0.5, 0.75 | 1.0, 1.2, 1.5
    assert tokens_per_second([a, b, c], width=0.5) == [2.0, 4.0, 4.0, 2.0]  # 1, 2, 2 and 1 chunks per 0.5 s


def test_report_and_result_file_use_vllms_names():
    ok = result(0.0, 0.2, [0.02] * 4, tokens=5, prompt=100, cached=64)
    bad = RequestResult(success=False, error="HTTP 500: scripted failure\ntraceback...")
    m = compute_metrics([ok, bad], 1.0, [50, 99.9], parse_goodput(["ttft:300"]))
    cfg = RunConfig("openai", None, "m", "/tok", "random", 2, float("inf"), 1.0, 4, "20260101-000000")
    text = format_report(m, cfg, [ok, bad])
    assert "Successful requests:                     1" in text
    assert "Failed requests:                         1" in text
    assert "Cached prompt tokens (share):            64 (64.0%)" in text
    assert "P99.9 TTFT (ms):" in text and "Error 0: HTTP 500: scripted failure" in text
    saved = result_dict(m, cfg, [ok, bad], detailed=False)
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99.9_e2el_ms",
                "p50_itl_ms", "request_rate", "burstiness", "max_concurrency", "model_id", "backend"):
        assert key in saved, key
    assert saved["request_rate"] == "inf" and saved["failed"] == 1 and saved["request_goodput"] == 1.0
    assert "ttfts" not in saved
    assert "client_cpu_s" not in saved and "Client CPU" not in text  # not measured: not reported
    timed = compute_metrics([ok, bad], 1.0, [50], client_cpu_s=0.0125)
    assert result_dict(timed, cfg, [ok, bad], detailed=False)["client_cpu_s"] == 0.0125
    assert "Client CPU per output token (ms):        2.500" in format_report(timed, cfg, [ok, bad])  # 12.5 ms / 5
    detailed = result_dict(m, cfg, [ok, bad], detailed=True)
    assert detailed["output_lens"] == [5, 0] and detailed["errors"][1].startswith("HTTP 500")
