#!/usr/bin/env bash
# Set up (or reuse) the virtualenv, then run the launcher demo: a lighthouse and 3 replica groups x 2 ranks training
# the tiny GPT (recipes/tiny_gpt.yaml); group b is killed at step 80, restarted, catches up; report in runs/demo.
# Extra arguments go to `fthsdp launch` (e.g. trainer.max_steps=300 --chaos kill:every=20s).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# --fresh: each run of the demo starts at step 0 (the last run's checkpoints are moved aside, never deleted).
exec fthsdp launch recipes/tiny_gpt.yaml --out runs/demo --fresh "$@"
