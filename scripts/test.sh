#!/usr/bin/env bash
# Set up (or reuse) the virtualenv, then run the linter and the whole test suite, on two pytest-xdist workers (most
# tests wait on real processes; a folder sharing a machine-wide resource keeps to one worker, see tests/conftest.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
ruff check src tests examples bench scripts
exec python -m pytest -q -n 2 --dist loadgroup "$@"
