#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv and installs everything into it. Sourced by demo.sh and test.sh.
# Torch: a machine with an NVIDIA GPU keeps or gets a CUDA build; a CPU-only machine gets the CPU build
# (torch==2.13.0 is the release whose CPU wheel these machines carry), never a multi-GB CUDA download.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FTHSDP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    # The user already has a torch (often a CUDA build): keep it visible instead of installing another.
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
"$VPY" -m pip install -q -e "$ROOT[test,sim,lightning,launch,accelerate,hf,uvloop]"
export PATH="$VENV/bin:$PATH"
