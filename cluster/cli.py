"""``pagefleet`` command line: ``serve`` (the OpenAI server on Ray Serve), ``demo-model``, ``plan``, ``bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagefleet.cluster.bench import benchmark as bench
from pagefleet.cluster.config import API_KEY_ENV, ServeArgs, ServeOptions
from pagefleet.cluster.demo.model import ARCHITECTURES, DEMO_SIZES, write_demo_checkpoint
from pagefleet.cluster.plan import cli as plan_cli
from pagefleet.cluster.serve_env import THREAD_WAIT_ENV
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.model_executor.model_config import DTYPES
from pagefleet.worker.options import add_cli_args

logger = logging.getLogger("pagefleet")


def main(argv: list[str] | None = None) -> int:
    # Before torch loads (here and in the Ray workers that inherit this environment).
    for name, value in THREAD_WAIT_ENV.items():
        os.environ.setdefault(name, value)
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
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
    add_cli_args(serve.add_argument_group("engine options"), EngineArgs)
    add_cli_args(serve.add_argument_group("serving options"), ServeArgs)
    serve.add_argument("--address", default=None,
                       help="join a running Ray cluster ('auto' or HOST:PORT) instead of starting a local one")
    serve.add_argument("--metrics-export-port", type=_port, default=8080,
                       help="port of the local Ray's metrics agent, where Prometheus scrapes the ray_pagefleet_* "
                            "series (a cluster joined with --address keeps its own)")
    serve.add_argument("--ray-control-priority", choices=("idle", "normal"), default="idle",
                       help="CPU priority of the local Ray's control processes (GCS, agents, log monitor, "
                            "Serve controller, global scheduler): idle (Linux SCHED_IDLE: they run on cores "
                            "nothing else wants, never preempting the engine or the request path) or normal "
                            "(as Ray starts them). A cluster joined with --address is left as it is")

    demo = sub.add_parser("demo-model", help="write a random-weight checkpoint with a locally trained tokenizer")
    demo.set_defaults(command="demo-model", run=_demo_model)
    demo.add_argument("--out", required=True, help="directory to write")
    demo.add_argument("--size", default="tiny", choices=list(DEMO_SIZES))
    demo.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    demo.add_argument("--dtype", default="float32", choices=DTYPES)
    demo.add_argument("--seed", type=int, default=0)
    plan_cli.register(sub)
    bench.register(sub)
    return parser


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is in 1..65535, got {port}")
    return port


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed `serve` flags; ValueError for values no flag type catches."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag
    return ServeOptions.from_namespace(args)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        key_on_command_line = any(a == "--api-key" or a.startswith("--api-key=") for a in args.argv)
        if key_on_command_line and args.api_key_file is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        opts = options_from_args(args)
        opts.serve.key()  # a key file that cannot be read stops the start here
    except ValueError as exc:
        print(f"pagefleet serve: error: {exc}", file=sys.stderr)
        return 2
    if key_on_command_line:
        print(f"pagefleet serve: warning: --api-key on the command line is visible to every user of this machine "
              f"(ps, /proc); set ${API_KEY_ENV} or use --api-key-file instead", file=sys.stderr)
    from pagefleet.cluster.launch import run_server

    return run_server(opts, address=args.address, metrics_export_port=args.metrics_export_port,
                      ray_control_priority=args.ray_control_priority)


def _demo_model(args: argparse.Namespace) -> int:
    path = write_demo_checkpoint(args.out, size=args.size, arch=args.arch, dtype=args.dtype, seed=args.seed)
    print(f"wrote a random-weight {args.size} {args.arch} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
