#!/usr/bin/env bash
# Installs pagefleet and its test tools into .venv (or $PAGEFLEET_VENV).
# torch: an importable torch is kept (a CUDA user's build stays); otherwise a
# machine with an NVIDIA GPU gets the default CUDA build and a CPU-only
# machine gets the CPU wheel torch==2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PAGEFLEET_VENV:-.venv}"
PY="${PYTHON:-python3}"
# Prometheus (Debian's package) for the metrics integration test, where it is missing and
# apt-get can run without a password prompt; without it that test skips (fails under CI=true).
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo_=""; elif sudo -n true 2>/dev/null; then sudo_="sudo -n"; else sudo_=none; fi
  if [ "$sudo_" != none ]; then
    { $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq \
        --no-install-recommends prometheus >/dev/null; } || echo "install.sh: could not install prometheus" >&2
  fi
fi
stamp="$VENV/.pagefleet-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $pip install -q torch
  else
    $pip install -q torch==2.13.0
  fi
fi
$pip install -q -e ".[dev]"
touch "$stamp"
