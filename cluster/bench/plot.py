"""``pagefleet bench --plot FILE.png``: latency CDFs and throughput over time (matplotlib,
the ``bench`` extra)."""

from __future__ import annotations

from pagefleet.cluster.bench.metrics import BenchMetrics, RequestResult, tokens_per_second, tpot

NICE_WIDTHS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


def bin_width(duration_s: float, bins: int = 60) -> float:
    """The smallest round width that cuts the run into at most ``bins`` bins."""
    return next((w for w in NICE_WIDTHS_S if duration_s / w <= bins), NICE_WIDTHS_S[-1])


def in_flight(results: list[RequestResult]) -> tuple[list[float], list[int]]:
    """The exact step function of requests in flight: (times since the first send, counts)."""
    ok = [r for r in results if r.success]
    if not ok:
        return [], []
    t0 = min(r.start_time for r in ok)
    events = sorted([(r.start_time - t0, 1) for r in ok] + [(r.start_time + r.latency - t0, -1) for r in ok])
    times, counts, running = [0.0], [0], 0
    for t, delta in events:
        running += delta
        times.append(t)
        counts.append(running)
    return times, counts


def plot(results: list[RequestResult], metrics: BenchMetrics, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    samples = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [t * 1e3 for t in (tpot(r) for r in ok) if t is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for name, values in samples.items():
        if values:
            xs = sorted(values)
            cdf.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                     label=f"{names[name]} (median {metrics.ms[name].median:.1f} ms)")
    cdf.set_xscale("log")
    cdf.set_xlabel("milliseconds (log scale)")
    cdf.set_ylabel("fraction of samples at or below")
    cdf.set_ylim(0, 1.02)
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(loc="upper left")
    cdf.set_title("Latency CDFs")

    width = bin_width(metrics.duration)
    rates = tokens_per_second(results, width)
    tput.bar([i * width for i in range(len(rates))], rates, width=width, align="edge", color="tab:blue", alpha=0.7)
    tput.set_xlabel(f"seconds since the first request (bins of {width:g} s)")
    tput.set_ylabel("output tokens per second", color="tab:blue")
    tput.grid(True, alpha=0.3)
    inflight = tput.twinx()
    times, counts = in_flight(results)
    inflight.step(times, counts, where="post", color="tab:red")
    inflight.set_ylabel("requests in flight", color="tab:red")
    inflight.set_ylim(bottom=0)
    tput.set_title(f"Throughput over time (mean {metrics.output_throughput:.1f} tok/s, "
                   f"{metrics.completed} ok, {metrics.failed} failed)")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
