"""benchmarks/_proc_cpu.py's per-thread scheduling figures: an engine's compute threads' CPU,
run-queue wait and involuntary context switches, as serving.py reports them for the engine alone and served."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _proc_cpu import read_thread, sched_per_token, thread_sched  # noqa: E402


def test_per_token_figures_sum_the_threads_deltas_and_count_a_new_threads_whole_life():
    before = {"10": (100.0, 40.0, 7), "11": (50.0, 0.0, 0)}
    after = {"10": (300.0, 100.0, 27), "11": (250.0, 20.0, 10), "12": (40.0, 4.0, 3)}
    assert sched_per_token(before, after, tokens=40, seconds=2.0) == {
        "threads": 3, "cpu_ms_per_token": 11.0, "runqueue_wait_ms_per_token": 2.1, "involuntary_switches_per_s": 16.5}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_a_live_sample_selects_threads_by_niceness_and_sees_their_cpu():
    lowered = threading.Event()
    stop = threading.Event()
    tid: list[int] = []

    def busy() -> None:
        tid.append(threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, tid[0], 17)  # this thread only (Linux)
        lowered.set()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=busy)
    t.start()
    try:
        assert lowered.wait(10)
        before = thread_sched(os.getpid(), nice=17)
        time.sleep(0.3)
        after = thread_sched(os.getpid(), nice=17)
    finally:
        stop.set()
        t.join()
    assert list(after) == [str(tid[0])]  # the main thread (niceness 0) is left out
    run = after[str(tid[0])][0]
    assert run - before[str(tid[0])][0] > 50.0  # ms on a CPU in 300 ms of spinning
    assert str(threading.get_native_id()) in thread_sched(os.getpid())  # no filter: every thread


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_a_threads_involuntary_switches_are_read_from_its_status_file():
    me = threading.get_native_id()

    def from_status() -> int:  # the involuntary count, not the voluntary one beside it
        status = Path(f"/proc/self/task/{me}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("nonvoluntary_ctxt_switches:")).split()[1])

    first = from_status()
    _, _, nice, involuntary = read_thread(os.getpid(), me)
    assert first <= involuntary <= from_status()  # it only grows: read between two reads of the file
    assert nice == os.getpriority(os.PRIO_PROCESS, me)
