"""benchmarks/cpu_contention.py: per-role CPU and run-queue wait from two schedstat samples, and
a live sample of this very process (Linux)."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_contention  # noqa: E402


def test_per_role_sums_threads_keeps_the_worst_thread_and_counts_a_new_threads_whole_life():
    before = {("1", "1"): ("ingress", 100.0, 50.0, 15), ("1", "2"): ("ingress", 10.0, 0.0, 0),
              ("2", "2"): ("worker", 0.0, 0.0, 19)}
    after = {("1", "1"): ("ingress", 300.0, 450.0, 15), ("1", "2"): ("ingress", 30.0, 100.0, 0),
             ("2", "2"): ("worker", 1000.0, 20.0, 19), ("2", "3"): ("worker", 70.0, 70.0, 15)}
    got = cpu_contention.per_role(before, after, seconds=2.0)
    assert got == {
        "ingress": {"cpu_ms_per_s": 110.0, "wait_ms_per_s": 250.0, "max_thread_wait_ms_per_s": 200.0, "nice": [0, 15]},
        "worker": {"cpu_ms_per_s": 535.0, "wait_ms_per_s": 45.0, "max_thread_wait_ms_per_s": 35.0, "nice": [15, 19]},
    }


def test_role_deltas_are_the_raw_sums_per_role_behind_the_rates():
    before = {("1", "1"): ("ingress", 100.0, 50.0, 15), ("2", "2"): ("worker", 0.0, 0.0, 19)}
    after = {("1", "1"): ("ingress", 112.5, 53.0, 15), ("1", "4"): ("ingress", 2.0, 1.0, 15),
             ("2", "2"): ("worker", 270.0, 33.0, 19)}
    assert cpu_contention.role_deltas(before, after) == {
        "ingress": {"cpu_ms": 14.5, "wait_ms": 4.0, "max_thread_wait_ms": 3.0, "nice": {15}},
        "worker": {"cpu_ms": 270.0, "wait_ms": 33.0, "max_thread_wait_ms": 33.0, "nice": {19}},
    }


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_a_live_sample_sees_a_busy_thread_of_a_process_with_a_role():
    me = str(os.getpid())
    role = lambda pid: "worker" if pid == me else None  # noqa: E731 — this process plays a worker
    spun, done = threading.Event(), threading.Event()

    def spin():  # runnable for 0.3 s, then asleep until sampled (an ended thread leaves /proc)
        stop = time.monotonic() + 0.3
        while time.monotonic() < stop:
            pass
        spun.set()
        done.wait()

    thread = threading.Thread(target=spin)
    before, t0 = cpu_contention.sample(role), time.monotonic()
    thread.start()
    spun.wait()
    after, t1 = cpu_contention.sample(role), time.monotonic()
    done.set()
    thread.join()
    assert {r for r, *_ in after.values()} == {"worker"}
    row = cpu_contention.per_role(before, after, t1 - t0)["worker"]
    # the spinning thread was runnable for its whole 0.3 s: on a CPU or waiting for one
    assert (row["cpu_ms_per_s"] + row["wait_ms_per_s"]) * (t1 - t0) >= 280
    assert row["cpu_ms_per_s"] > 0
