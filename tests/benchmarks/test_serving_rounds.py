"""benchmarks/serving.py's figures over rounds: each round's ratios come from that round's runs
only, and the summary gives every round's value and their median."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving import median_overhead, overhead  # noqa: E402


def _line(tok_s: float, ttft: float, tpot: float) -> dict:
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_mean_ms": tpot}


def test_a_round_compares_its_own_runs():
    line = overhead(16, _line(200.0, 1000.0, 50.0), _line(180.0, 1100.0, 55.5), {"vllm-serve": _line(120.0, 0, 0)})
    assert line == {"summary": "ray_path_overhead", "concurrency": 16, "ttft_p50_added_ms": 100.0,
                    "tpot_added_ms": 5.5, "tok_s_vs_engine": 0.9, "tok_s_vs_vllm_serve": 1.5}


def test_the_median_is_over_per_round_ratios_not_over_pooled_runs():
    # The machine is fast in round 1: both systems are; the served/engine ratio is what carries over.
    rounds = [
        {"engine-alone": {1: _line(40.0, 150.0, 20.0)}, "pagefleet-serve": {1: _line(36.0, 170.0, 21.0)}},
        {"engine-alone": {1: _line(60.0, 100.0, 14.0)}, "pagefleet-serve": {1: _line(57.0, 104.0, 14.2)}},
        {"engine-alone": {1: _line(44.0, 140.0, 19.0)}, "pagefleet-serve": {1: _line(37.4, 150.0, 20.0)}},
        {"pagefleet-serve": {1: _line(99.0, 1.0, 1.0)}},  # a round without the engine alone adds nothing
    ]
    assert median_overhead(1, rounds) == {
        "summary": "ray_path_overhead_median", "concurrency": 1, "rounds": 3,
        "ttft_p50_added_ms": {"median": 10.0, "rounds": [20.0, 4.0, 10.0]},
        "tpot_added_ms": {"median": 1.0, "rounds": [1.0, 0.2, 1.0]},
        "tok_s_vs_engine": {"median": 0.9, "rounds": [0.9, 0.95, 0.85]}}
    assert median_overhead(4, rounds[3:]) is None


def test_cpu_per_token_outside_the_worker_always_and_the_engines_difference_only_without_spin(monkeypatch):
    import serving

    engine = {**_line(200.0, 1000.0, 50.0), "cpu_ms_per_token": {"engine": 9.0}}
    served = {**_line(180.0, 1100.0, 55.0), "cpu_ms_per_token": {"worker": 9.5, "ingress": 0.5, "proxy": 0.25},
              "client_cpu_ms_per_token": 0.75}
    monkeypatch.setattr(serving, "alone_env", lambda: {"OMP_WAIT_POLICY": "PASSIVE"})
    passive = overhead(16, engine, served, {})
    assert (passive["outside_worker_cpu_ms_per_token"], passive["path_cpu_ms_per_token"]) == (0.75, 1.25)
    # The ceiling on a machine whose cores the engine shares: 9 of 10.25 ms a token, then of 11 with the client.
    assert passive["cpu_bound_tok_s_ceiling_vs_engine"] == 0.878
    assert (passive["client_cpu_ms_per_token"], passive["cpu_bound_tok_s_ceiling_with_client_vs_engine"]) == (0.75, 0.818)
    # A spinning team's waits count as CPU: the engines' difference would not be the path's work.
    monkeypatch.setattr(serving, "alone_env", lambda: {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"})
    spinning = overhead(16, engine, served, {})
    assert spinning["outside_worker_cpu_ms_per_token"] == 0.75 and "path_cpu_ms_per_token" not in spinning
    assert spinning["client_cpu_ms_per_token"] == 0.75 and "cpu_bound_tok_s_ceiling_with_client_vs_engine" not in spinning


def test_whether_libgomp_spins_follows_its_own_rules():
    from pagefleet.worker.cpu.threads import libgomp_spins

    assert not libgomp_spins({"OMP_WAIT_POLICY": "PASSIVE"})
    assert libgomp_spins({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"})  # the count wins
    assert not libgomp_spins({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"})
    assert libgomp_spins({"OMP_WAIT_POLICY": "active"})
    assert libgomp_spins({})  # libgomp's default spins


def test_the_engine_alone_keeps_a_users_wait_policy():
    from serving import alone_env

    assert alone_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in alone_env({"OMP_WAIT_POLICY": "ACTIVE"})
    assert alone_env({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"
    assert alone_env({})["OMP_WAIT_POLICY"] == "PASSIVE"
