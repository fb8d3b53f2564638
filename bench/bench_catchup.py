"""Catch-up benchmark: what admitting a restarted group costs the healthy groups, and how long a restart takes.

    python bench/bench_catchup.py --mib 64 512        # writes bench/results/catchup.json

Two healthy groups of examples/train_plain.py train with ``--ballast-mib`` extra state (so the state that travels
is that large); a third group starts fresh and catches up (following the job while the transfer runs, then
replaying the steps it followed). Measured from the groups' JSONL logs:
- admit ratio: the healthy groups' step time in the step that admits the recovering group (the one it joins the
  quorum in, when the source snapshots its state), over their steady median (same run). Target <= 1.10.
- worst ratio: the slowest healthy step from that one to the step after the recovering group's first commit.
Two admissions per job (b, then d, both from a): the first snapshot a source takes copies into the memory it
reserved after its first step, the second into the first's (both already mapped).
- the restarted process's time to its first committed step, split into process start (interpreter and imports),
  model build (model, optimizer, manager), fetch (state transfer) and the rest of that first step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lightning_fthsdp.testing.harness import Job, wait_for

RESULTS = Path(__file__).resolve().parent / "results"


def measure(mib: int, step_time_ms: int) -> list[dict[str, float]]:
    """Two admissions in one job: b, then d, both from source a."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp), min_replicas=2, heartbeat_timeout_ms=2_000, join_timeout_ms=2_000,
                  collective_timeout_ms=30_000)
        try:
            job.start_lighthouse()
            extra = ("--ballast-mib", str(mib))
            a, c = (job.start_group(r, 100_000, step_time_ms=step_time_ms, extra=extra) for r in "ac")
            wait_for(lambda: min(a.last_step(), c.last_step()) >= 30, 300, "a and c to reach step 30")
            joins = []
            for joiner in "bd":
                spawned = time.time()
                group = job.start_group(joiner, 100_000, step_time_ms=step_time_ms, extra=extra)
                first = wait_for(lambda g=group: g.records(), 300, f"{joiner}'s first committed step")[0]
                wait_for(lambda f=first: a.last_step() >= f["step"] + 15, 120, f"a to train on after {joiner}")
                joins.append((spawned, group.records("ready")[0], first))
            commits = {r["step"]: r["t"] for r in a.records()}
        finally:
            job.close()
    durations = {s: commits[s] - commits[s - 1] for s in commits if s - 1 in commits}
    rows = []
    for admission, (spawned, ready, first) in enumerate(joins, 1):
        recovery = first["recovery"]
        admit = recovery["step"] + 1  # a's step that the joiner joined in, contributing zeros as its transfer began
        steady = statistics.median(d for s, d in durations.items() if admit - 15 <= s < admit - 1)
        fetch_s = float(recovery["fetch_s"])
        rows.append({
            "state_mib": mib,
            "admission": admission,
            "steady_step_s": steady,
            "admit_step_s": durations[admit],
            "admit_ratio": durations[admit] / steady,
            "worst_ratio": max(durations[s] for s in range(admit, first["step"] + 2)) / steady,
            "replayed_steps": int(recovery["replayed"]),
            "process_start_s": ready["imports_done"] - spawned,
            "model_build_s": ready["t"] - ready["imports_done"],
            "fetch_s": fetch_s,
            "first_step_rest_s": first["t"] - ready["t"] - fetch_s,
            "to_first_commit_s": first["t"] - spawned,
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--step-time-ms", type=int, default=60, help="pace of the healthy groups' steps")
    args = parser.parse_args()
    rows = [row for mib in args.mib for row in measure(mib, args.step_time_ms)]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "catchup.json").write_text(json.dumps(rows, indent=2))
    cols = ("state_mib", "admission", "steady_step_s", "admit_step_s", "admit_ratio", "worst_ratio", "replayed_steps",
            "process_start_s", "model_build_s", "fetch_s", "first_step_rest_s", "to_first_commit_s")
    print(" ".join(f"{c:>17}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>17.3f}" if isinstance(row[c], float) else f"{row[c]:>17}" for c in cols))
    print(f"target: admit_ratio <= 1.10; wrote {RESULTS / 'catchup.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
