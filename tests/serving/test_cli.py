"""`pagefleet serve` flags and the early failures that need no cluster."""

import pytest

from pagefleet.cluster.cli import _parser, main, options_from_args
from pagefleet.cluster.launch import banner


def _opts(*argv):
    return options_from_args(_parser().parse_args(["serve", *argv]))


def test_defaults_serve_the_demo_on_loopback_8000(monkeypatch):
    monkeypatch.delenv("PAGEFLEET_API_KEY", raising=False)
    opts = _opts()
    assert (opts.engine.model, opts.serve.host, opts.serve.port) == (None, "127.0.0.1", 8000)
    assert (opts.serve.workers, opts.engine.tensor_parallel_size, opts.serve.api_key) == (1, 1, None)
    monkeypatch.setenv("PAGEFLEET_API_KEY", "from-env")
    assert _opts().serve.api_key == "from-env"


def test_vllm_named_flags_reach_the_engine_args():
    opts = _opts("--model", "/ckpt", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "9000",
                 "--workers", "3", "--tensor-parallel-size", "2", "--dtype", "half", "--max-model-len", "512",
                 "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                 "--kv-cache-bytes", "512MiB", "--api-key", "k", "--seed", "7", "--no-enable-prefix-caching")
    args = opts.engine
    assert (opts.serve.host, opts.serve.port, opts.serve.workers, opts.serve.api_key) == ("0.0.0.0", 9000, 3, "k")
    assert (args.model, args.served_model_name, args.tensor_parallel_size, args.dtype) == ("/ckpt", ["m"], 2, "float16")
    assert (args.max_model_len, args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (512, 32, 8, 256)
    assert (args.kv_cache_bytes, args.seed, args.enable_prefix_caching) == (512 * 2**20, 7, False)
    assert _opts("/ckpt2").engine.model == "/ckpt2"
    assert _opts("-tp", "2").engine.tensor_parallel_size == 2
    assert _opts("--worker-cpus", "0.5").serve.worker_num_cpus == 0.5
    assert _opts("--gpu-memory-utilization", "0.8").engine.gpu_memory_utilization == 0.8


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-bytes", "lots"], "not a byte size: 'lots'"),
    (["--block-size", "7"], "invalid choice: 7"),
    (["--port", "http"], "invalid int value: 'http'"),
])
def test_bad_flags_exit_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-bytes", "1GiB", "--gpu-memory-utilization", "0.5"], "not both"),
    (["--workers", "0"], "workers must be an integer >= 1, got 0"),
    (["--dtype", "fp8"], "unsupported dtype 'fp8'"),
    (["/a", "--model", "/b"], "two models given"),
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice needs tool_call_parser"),
])
def test_bad_combinations_exit_before_any_cluster_starts(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_fails_before_any_cluster_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # restored afterwards: run_server sets it for a local Ray
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not download models" in capsys.readouterr().err


def test_banner_shows_where_and_how(capsys):
    from pagefleet.cluster.config import ServeOptions

    key = "s3cret-9f1c"
    text = banner(ServeOptions.from_dict({"port": 8123, "api_key": key, "workers": 2}), "demo", 12.3, local=True)
    assert "http://127.0.0.1:8123/v1" in text
    assert "curl http://127.0.0.1:8123/v1/chat/completions" in text
    assert key not in text  # the banner names where the key is, never the key
    assert '"Authorization: Bearer $PAGEFLEET_API_KEY"' in text
    assert '"model": "demo"' in text
    assert "2 worker replica(s)" in text


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_metrics_export_port_is_a_ray_bring_up_flag():
    args = _parser().parse_args(["serve", "--metrics-export-port", "9100"])
    assert args.metrics_export_port == 9100
    assert _parser().parse_args(["serve"]).metrics_export_port == 8080
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--metrics-export-port", "70000"])


def test_ray_control_priority_is_a_ray_bring_up_flag_idle_by_default(monkeypatch):
    from pagefleet.cluster import launch

    seen = []
    monkeypatch.setattr(launch, "run_server", lambda opts, **kw: seen.append(kw["ray_control_priority"]) or 0)
    assert main(["serve", "--model", "/ckpt"]) == 0
    assert main(["serve", "--model", "/ckpt", "--ray-control-priority", "normal"]) == 0
    assert seen == ["idle", "normal"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--ray-control-priority", "high"])


def test_banner_says_where_prometheus_scrapes_and_what_ctrl_c_stops():
    from pagefleet.cluster.config import ServeOptions

    opts = ServeOptions.from_dict({})
    local = banner(opts, "demo", 1.0, local=True, metrics_targets=["10.0.0.5:8080"])
    assert "scrape Ray's metrics agent at 10.0.0.5:8080" in local
    assert ("Ctrl-C or SIGTERM lets the requests in flight finish (up to 30 s; new ones get 503), then stops "
            "the server and the local Ray cluster; a second one stops at once.") in local
    joined = banner(opts, "demo", 1.0, local=False, metrics_targets=["10.0.0.5:8080", "10.0.0.6:8080"],
                    started_serve=True)
    assert "scrape Ray's metrics agents at 10.0.0.5:8080, 10.0.0.6:8080" in joined
    assert "removes the app and the Serve instance this command started" in joined
    shared = banner(opts, "demo", 1.0, local=False, metrics_targets=[], started_serve=False)
    assert "then removes the app; Serve and the Ray cluster keep running; a second" in shared


def test_join_errors_are_one_sentence_with_the_fix():
    from ray.exceptions import AuthenticationError

    from pagefleet.cluster.ray_join import ServeHTTP, join_error, serve_conflict

    try:
        try:
            raise AuthenticationError("InvalidAuthToken: token is missing")
        except AuthenticationError as inner:
            raise RuntimeError("Failed to connect to GCS") from inner
    except RuntimeError as outer:
        wrapped = ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379")
        wrapped.__cause__ = outer
    text = join_error("10.0.0.5:6379", wrapped)
    assert text.startswith("the Ray cluster at 10.0.0.5:6379 refused this machine's credentials")
    assert "RAY_AUTH_MODE=token" in text and "~/.ray/auth_token" in text and "\n" not in text
    plain = join_error("10.0.0.5:6379", ConnectionError("no route"))
    assert plain.startswith("could not join a Ray cluster at 10.0.0.5:6379 (ConnectionError)")
    assert serve_conflict(None, "127.0.0.1", 8000) is None
    assert serve_conflict(ServeHTTP("127.0.0.1", 8000), "127.0.0.1", 8000) is None
    conflict = serve_conflict(ServeHTTP("0.0.0.0", 8000), "127.0.0.1", 9000)
    assert "--host 0.0.0.0 --port 8000" in conflict and "serve shutdown" in conflict
