"""Every option is defined once: each EngineArgs / ServeArgs field is a `pagefleet serve` flag, a
`serve.yaml` arg and (engine options) an `LLM(...)` keyword, with the same default and value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pagefleet.cluster.cli import _parser, options_from_args
from pagefleet.cluster.config import ServeArgs, ServeOptions
from pagefleet.worker.engine import llm as llm_module
from pagefleet.worker.engine_args import CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_SEQS, EngineArgs, default_max_num_seqs
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.options import default_of, flag_name, option_fields

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"

# A value other than the default for each option: (the flag's text, the value it means). A
# boolean's text is None: its flag alone (--x) means True, --no-x False.
OTHER_VALUES = {
    "model": ("/ckpt", "/ckpt"),
    "served_model_name": ("m", ["m"]),
    "dtype": ("bf16", "bfloat16"),
    "device": ("cpu", "cpu"),
    "block_size": ("32", 32),
    "max_num_seqs": ("8", 8),
    "scheduling_policy": ("priority", "priority"),
    "max_num_batched_tokens": ("512", 512),
    "max_model_len": ("1024", 1024),
    "kv_cache_bytes": ("2GiB", 2 * 2**30),
    "gpu_memory_utilization": ("0.5", 0.5),
    "kv_cache_dtype": ("fp8", "fp8"),
    "enable_prefix_caching": (None, False),  # --no-enable-prefix-caching
    "tensor_parallel_size": ("2", 2),
    "seed": ("7", 7),
    "load_format": ("dummy", "dummy"),
    "log_stats_interval": ("2.5", 2.5),
    "stream_interval": ("4", 4),
    "num_scheduler_steps": ("8", 8),
    "async_output_proc": (None, True),  # --async-output-proc
    "async_scheduling": (None, True),  # --async-scheduling
    "otlp_traces_endpoint": ("http://collector:4318/v1/traces", "http://collector:4318/v1/traces"),
    "trust_remote_code": (None, False),  # the only value it takes: true is refused (test below)
    "max_stop_strings": ("4", 4),
    "max_stop_string_chars": ("64", 64),
    "max_stop_token_ids": ("8", 8),
    "cpu_omp_threads": ("3", 3),
    "enable_lora": (None, True),  # --enable-lora
    "max_loras": ("4", 4),
    "max_lora_rank": ("64", 64),
    "max_cpu_loras": ("8", 8),
    "lora_modules": ("sql=/adapters/sql", [LoRAModulePath("sql", "/adapters/sql")]),  # with --enable-lora (NEEDS)
    "enforce_eager": (None, True),  # --enforce-eager
    "quantization": ("fp8", "fp8"),
    "simulate": ("h100", "h100"),
    "simulate_efficiency": ("0.73", 0.73),
    "host": ("0.0.0.0", "0.0.0.0"),
    "port": ("9000", 9000),
    "workers": ("3", 3),
    "target_ongoing_requests": ("12", 12.0),
    "upscale_delay_s": ("5", 5.0),
    "downscale_delay_s": ("60", 60.0),
    "autoscaling_config": ('{"look_back_period_s": 20}', {"look_back_period_s": 20}),
    "autoscaling_policy": ("kv", "kv"),
    "api_key": ("k", "k"),
    "api_key_file": ("/etc/pagefleet/api-key", "/etc/pagefleet/api-key"),
    "worker_num_cpus": ("0.5", 0.5),
    "worker_num_gpus": ("1", 1.0),
    "ingress_num_cpus": ("0.25", 0.25),
    "ingress_replicas": ("2", 2),
    "routing": ("round_robin", "round_robin"),
    "routing_cost_weight": ("1.5", 1.5),
    "admission_queue_size": ("0", 0),
    "admission_max_wait_s": ("0.5", 0.5),
    "routing_max_staleness_s": ("0.5", 0.5),
    "max_request_body_bytes": ("1MiB", 2**20),
    "max_prompts_per_request": ("16", 16),
    "max_prompt_chars": ("10000", 10000),
    "max_request_id_chars": ("64", 64),
    "max_chat_messages": ("100", 100),
    "max_unstreamed_response_tokens": ("65536", 65536),
    "tool_call_parser": ("mistral", "mistral"),
    "reasoning_parser": ("qwen3", "qwen3"),
    "enable_auto_tool_choice": (None, True),  # --enable-auto-tool-choice, with a parser (NEEDS below)
    "drain_timeout_s": ("5", 5.0),
    "allow_runtime_lora_updating": (None, True),  # --allow-runtime-lora-updating, with --enable-lora (NEEDS)
}
# What an option's other value needs beside it: (flag, text) and the config key's value.
NEEDS = {"enable_auto_tool_choice": (["--tool-call-parser", "hermes"], {"tool_call_parser": "hermes"}),
         "lora_modules": (["--enable-lora"], {"enable_lora": True}),
         "allow_runtime_lora_updating": (["--enable-lora"], {"enable_lora": True})}
ENGINE_FIELDS = [f.name for f in option_fields(EngineArgs)]
SERVE_FIELDS = [f.name for f in option_fields(ServeArgs)]


@pytest.fixture(autouse=True)
def _no_api_key_env(monkeypatch):
    monkeypatch.delenv("PAGEFLEET_API_KEY", raising=False)


def _cli(*argv: str) -> ServeOptions:
    return options_from_args(_parser().parse_args(["serve", *argv]))


def _part(opts: ServeOptions, name: str):
    return opts.engine if name in ENGINE_FIELDS else opts.serve


def test_the_table_above_covers_every_option():
    assert sorted(OTHER_VALUES) == sorted(ENGINE_FIELDS + SERVE_FIELDS)
    assert not set(ENGINE_FIELDS) & set(SERVE_FIELDS)


RESOLVED = {"max_num_seqs": default_max_num_seqs("auto", None)}


@pytest.mark.parametrize("name", ENGINE_FIELDS + SERVE_FIELDS)
def test_option_has_one_default_everywhere(name):
    cls = EngineArgs if name in ENGINE_FIELDS else ServeArgs
    (field,) = [f for f in option_fields(cls) if f.name == name]
    # A default of None that the engine resolves at construction, by the machine it runs on.
    default = RESOLVED[name] if name in RESOLVED else default_of(field)
    assert getattr(_part(_cli(), name), name) == default                      # no flag given
    assert getattr(_part(ServeOptions.from_dict({}), name), name) == default  # serve.yaml without the key
    assert getattr(cls(), name) == default                                    # LLM(...) / build_app without it


@pytest.mark.parametrize("name", ENGINE_FIELDS + SERVE_FIELDS)
def test_option_means_the_same_as_flag_yaml_arg_and_keyword(name):
    text, value = OTHER_VALUES[name]
    flag = flag_name(next(f for f in dataclasses.fields(EngineArgs) + dataclasses.fields(ServeArgs)
                          if f.name == name))
    argv = ([flag] if value else [f"--no-{flag[2:]}"]) if text is None else [flag, text]
    more_argv, more_keys = NEEDS.get(name, ([], {}))
    assert getattr(_part(_cli(*argv, *more_argv), name), name) == value
    as_yaml = yaml.safe_load(yaml.safe_dump({name: value if text is None else yaml.safe_load(text), **more_keys}))
    assert getattr(_part(ServeOptions.from_dict(as_yaml), name), name) == value


@pytest.mark.parametrize("name", ENGINE_FIELDS)
def test_engine_option_is_an_llm_keyword(name, monkeypatch):
    seen = []
    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: seen.append(args) or _Stub())
    _, value = OTHER_VALUES[name]
    kwargs = {"model": "/ckpt", name: value, **NEEDS.get(name, ([], {}))[1]}
    llm_module.LLM(**kwargs)
    assert getattr(seen[0], name) == value


class _Stub:
    tokenizer = None


def test_shipped_serve_yaml_agrees_with_the_flags():
    config = yaml.safe_load(SERVE_YAML.read_text())
    (app,) = config["applications"]
    args = app["args"]
    opts = ServeOptions.from_dict(args)  # every key is an option
    for name, value in args.items():
        cls = EngineArgs if name in ENGINE_FIELDS else ServeArgs
        field = next(f for f in option_fields(cls) if f.name == name)
        # The file shows knobs at their defaults; it must never disagree with the flags silently.
        assert value == default_of(field), name
        assert getattr(_part(opts, name), name) == value


def test_a_secret_option_never_shows(monkeypatch, capsys):
    monkeypatch.setenv("PAGEFLEET_API_KEY", "s3cret-key")
    opts = _cli()
    assert opts.serve.api_key == "s3cret-key"
    assert "s3cret-key" not in repr(opts)
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    assert "s3cret-key" not in capsys.readouterr().out


def test_trust_remote_code_is_refused_however_it_comes_in(monkeypatch):
    """pagefleet runs no code from a model directory: the vLLM flag is known, and refused clearly."""
    message = "trust_remote_code is not supported"
    with pytest.raises(ValueError, match=message):
        _cli("--trust-remote-code")
    with pytest.raises(ValueError, match=message):
        ServeOptions.from_dict({"trust_remote_code": True})
    monkeypatch.setattr(llm_module, "LLMEngine", lambda args: _Stub())
    with pytest.raises(ValueError, match=message):
        llm_module.LLM(model="/ckpt", trust_remote_code=True)


def test_served_engines_share_the_cores_among_the_apps_engine_ranks():
    def threads(cores, **args):
        return ServeOptions.from_dict(args).engine_args_for_this_machine(cores).cpu_omp_threads

    assert threads(2) == 2                                            # every core, computing at the lowest priority
    assert threads(17, workers=2, tensor_parallel_size=2) == 4
    assert threads(2, workers=2) == 1
    assert threads(2, workers=3) == 1                                 # never below one thread
    assert threads(64, cpu_omp_threads=3) == 3                        # the option wins


def test_max_num_seqs_defaults_to_256_on_cuda_and_64_elsewhere(monkeypatch):
    import torch

    assert (CUDA_MAX_NUM_SEQS, CPU_MAX_NUM_SEQS) == (256, 64)
    assert EngineArgs(device="cuda").max_num_seqs == 256
    assert EngineArgs(device="cpu").max_num_seqs == 64
    assert EngineArgs(device="cuda", simulate="h200").max_num_seqs == 64  # the simulator keeps its calibration
    assert EngineArgs(device="cuda", max_num_seqs=8).max_num_seqs == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineArgs().max_num_seqs == 256  # auto on a machine with a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineArgs().max_num_seqs == 64
