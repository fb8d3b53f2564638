"""Catch-up benchmark: what admitting a restarted group costs the healthy groups, and how long a restart takes.

    python bench/bench_catchup.py --mib 64 512        # writes bench/results/catchup.json

Two healthy groups of lightning_fthsdp.demo.train_plain (a, c) train with ``--ballast-mib`` extra state (so the
state that travels is that large); a third group, b, is started fresh, catches up (following the job while the
transfer runs, then replaying the steps it followed), trains 15 steps and is SIGKILLed; then the same again,
``--admissions`` times per state size. Measured from the groups' JSONL logs, per admission:
- admit ratio: the healthy groups' step time in the step that admits b (the one b joins the quorum in, when the
  source snapshots its state and b's transfer starts), over their steady median: the 20 steps before b's process
  was started (after the previous kill had settled). Target <= 1.10.
- admit vs full: the same step over the healthy groups' median once b is back (steps 3 to 14 after b's first commit):
  what admitting costs beyond the quorum having one member more (a third process's collective on 2 shared cores).
- worst ratio: the slowest healthy step from the admitting one to the step after b's first commit. Target <= 1.5.
- the restarted process's time to its first committed step, split into process start (interpreter and imports),
  model build (model, optimizer, manager), fetch (state transfer) and the rest of that first step.
On a 2-core machine every process shares the same cores (a real job's recovering group has hosts of its own), so a
single step's time swings by several milliseconds: the summary gives the median and the worst admission.

``--smoke``: 1 MiB, one admission (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_fthsdp.launch.processes import Job, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
STEADY_STEPS = 20


def measure(mib: int, step_time_ms: int, admissions: int, keep: Path | None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep / f"{mib}mib" if keep is not None else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        job = Job(workdir, min_replicas=2, heartbeat_timeout_ms=2_000, join_timeout_ms=2_000,
                  collective_timeout_ms=30_000)
        try:
            job.start_lighthouse()
            extra = ("--ballast-mib", str(mib))
            a, c = (job.start_group(r, 100_000, step_time_ms=step_time_ms, extra=extra) for r in "ac")
            wait_for(lambda: min(a.last_step(), c.last_step()) >= 10, 300, "a and c to reach step 10")
            joins = []
            for _ in range(admissions):
                settled = a.last_step()
                wait_for(lambda s=settled: a.last_step() >= s + STEADY_STEPS + 1, 120, "a's steady steps")
                spawned = time.time()
                b = job.start_group("b", 100_000, step_time_ms=step_time_ms, extra=extra)
                first = wait_for(lambda t=spawned, g=b: _after(g.records(), t), 300, "b's first committed step")
                wait_for(lambda f=first: a.last_step() >= f["step"] + 15, 120, "a to train on after b's first step")
                os.killpg(b.proc.pid, signal.SIGKILL)
                job.wait_exit(b, 30)
                joins.append((spawned, _after(b.records("ready"), spawned), first))
            commits = {r["step"]: r["t"] for r in a.records()}
        finally:
            job.close()
    durations = {s: (t, commits[s] - commits[s - 1]) for s, t in commits.items() if s - 1 in commits}
    rows = []
    for admission, (spawned, ready, first) in enumerate(joins, 1):
        catch_up = first["catch_up"]
        admit = catch_up["step"] + 1  # a's step that b joined in, contributing zeros as its transfer began
        before = sorted((t, d) for t, d in durations.values() if t <= spawned)[-STEADY_STEPS:]
        steady = statistics.median(d for _, d in before)
        full = statistics.median(durations[s][1] for s in range(first["step"] + 3, first["step"] + 15))
        fetch_s = float(catch_up["fetch_s"])
        rows.append({
            "state_mib": mib,
            "admission": admission,
            "steady_step_s": steady,
            "admit_step_s": durations[admit][1],
            "admit_ratio": durations[admit][1] / steady,
            "admit_vs_full": durations[admit][1] / full,
            "worst_ratio": max(durations[s][1] for s in range(admit, first["step"] + 2)) / steady,
            "replayed_steps": int(catch_up["replayed"]),
            "process_start_s": ready["imports_done"] - spawned,
            "model_build_s": ready["t"] - ready["imports_done"],
            "fetch_s": fetch_s,
            "first_step_rest_s": first["t"] - ready["t"] - fetch_s,
            "to_first_commit_s": first["t"] - spawned,
        })
    return rows


def _after(records: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The first record written after time ``t`` (this incarnation's: the log is appended to across restarts)."""
    return next((r for r in records if r["t"] > t), None)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mib in sorted({r["state_mib"] for r in rows}):
        of = [r for r in rows if r["state_mib"] == mib]
        ratios = [r["admit_ratio"] for r in of]
        out.append({"state_mib": mib, "admissions": len(of), "admit_ratio_median": statistics.median(ratios),
                    "admit_ratio_max": max(ratios),
                    "admit_vs_full_median": statistics.median(r["admit_vs_full"] for r in of),
                    "worst_ratio_median": statistics.median(r["worst_ratio"] for r in of),
                    "worst_ratio_max": max(r["worst_ratio"] for r in of)})
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    print(" ".join(f"{c:>18}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>18.3f}" if isinstance(row[c], float) else f"{row[c]:>18}" for c in cols))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--step-time-ms", type=int, default=60, help="pace of the healthy groups' steps")
    parser.add_argument("--admissions", type=int, default=5, help="admissions of b per state size")
    parser.add_argument("--keep", type=Path, default=None, help="keep the processes' logs under this folder")
    parser.add_argument("--out", type=Path, default=RESULTS / "catchup.json", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 1 MiB, one admission")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.admissions = [1], 1
    rows = [row for mib in args.mib for row in measure(mib, args.step_time_ms, args.admissions, args.keep)]
    summary = summarise(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"admissions": rows, "summary": summary}, indent=2))
    _print(rows)
    print()
    _print(summary)
    print(f"targets: admit_ratio <= 1.10; worst_ratio (every healthy step of an admission) <= 1.5; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
