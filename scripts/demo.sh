#!/usr/bin/env bash
# Set up (or reuse) the virtualenv, then run the local fault-injection demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec fthsdp demo "$@"
