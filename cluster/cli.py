"""``pagefleet`` command line: ``serve`` (the OpenAI server on Ray Serve) and ``demo-model``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagefleet.cluster.config import ServeOptions, parse_bytes

logger = logging.getLogger("pagefleet")


def main(argv: list[str] | None = None) -> int:
    # Before torch loads (here and in the Ray workers that inherit this environment):
    # libgomp's default spin-waiting makes small matmuls ~30x slower on a busy few-core host.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet", description="LLM serving on Ray")
    parser.set_defaults(command=None)
    sub = parser.add_subparsers(title="commands")

    serve = sub.add_parser("serve", help="serve the OpenAI API from worker replicas on a Ray cluster",
                           description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, ...) "
                                       "from --workers engine replicas behind Ray Serve.")
    serve.set_defaults(command="serve", run=_serve)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory (same as --model)")
    serve.add_argument("--model", default=None,
                       help="Hugging Face checkpoint directory (default: the built-in demo checkpoint, random weights)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: directory name)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="engine replicas")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (ranks) per replica")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    memory = serve.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-bytes", type=_byte_size, default=None,
                        help="KV cache budget per replica, e.g. 512MiB or 2GiB (the CPU default is 512MiB)")
    memory.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of GPU memory for weights, activations and KV cache (default 0.9)")
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    serve.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--api-key", default=os.environ.get("PAGEFLEET_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes (or set PAGEFLEET_API_KEY)")
    serve.add_argument("--address", default=None,
                       help="join a running Ray cluster ('auto' or HOST:PORT) instead of starting a local one")
    serve.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per TP rank")

    demo = sub.add_parser("demo-model", help="write a random-weight checkpoint with a locally trained tokenizer")
    demo.set_defaults(command="demo-model", run=_demo_model)
    demo.add_argument("--out", required=True, help="directory to write")
    demo.add_argument("--size", default="tiny", choices=["tiny", "small"])
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    demo.add_argument("--seed", type=int, default=0)
    return parser


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return ServeOptions(
        model=args.model or args.model_tag, served_model_name=args.served_model_name, host=args.host,
        port=args.port, workers=args.workers, tensor_parallel_size=args.tensor_parallel_size, dtype=dtype,
        device=args.device, max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, load_format=args.load_format, seed=args.seed,
        api_key=args.api_key, worker_num_cpus=args.worker_cpus)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = options_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagefleet serve: error: {exc}", file=sys.stderr)
        return 2
    from pagefleet.cluster.launch import run_server

    return run_server(opts, address=args.address)


def _demo_model(args: argparse.Namespace) -> int:
    from pagefleet.worker.demo_model import write_demo_checkpoint

    path = write_demo_checkpoint(args.out, size=args.size, arch=args.arch, dtype=args.dtype, seed=args.seed)
    print(f"wrote a random-weight {args.size} {args.arch} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
