#!/usr/bin/env bash
# The one prepared GPU check (see benchmarks/gpu_check.py for what it prints).
#   bash benchmarks/gpu_check.sh             # on a machine with one CUDA GPU, < 8 minutes
#   bash benchmarks/gpu_check.sh --dry-run   # on CPU, tiny shapes, well under a minute
# Python: $PYTHON, else the repo's .venv, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
# `pip install -e .` maps pagefleet.kernels -> kernels/ and so on. A bare copy
# of the repo (the GPU machine has no network to install into) gets the same
# namespace from a temporary folder of links.
SHIM=""
if ! "$PY" -c "import pagefleet.kernels.ops, pagefleet.worker" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir "$SHIM/pagefleet"
  for pkg in kernels worker router cluster; do ln -s "$ROOT/$pkg" "$SHIM/pagefleet/$pkg"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
cleanup() { if [ -n "$SHIM" ]; then rm -rf "$SHIM"; fi; }
trap cleanup EXIT
export TOKENIZERS_PARALLELISM=false
# Triton 3.9 warns until this is set; 1 keeps its current default (FMA contraction on).
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
# The script keeps to its own 420 s budget; this is the backstop under 8 minutes.
timeout --signal=INT --kill-after=10 465 "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
