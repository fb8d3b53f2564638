"""Does a failure cost accuracy? The tiny GPT recipe (3 groups x 2 ranks) with and without failures, over seeds.

For each seed, one ``fthsdp launch recipes/tiny_gpt.yaml`` per failure schedule: none, the demo's (group b killed
at step 80), a harsher one (three kills and a hang), and the harsher one with ``ft.keep_global_batch=true`` (the
healthy groups train the missing groups' batches, so degraded steps see a full global batch). Each run ends with
the held-out validation loss at its last step (a slice of the corpus no group trains on; every group holds the
same parameters, so they report the same value). The baseline is the fault-free runs of the same seeds: a
schedule's cost is its paired difference to them, set against their seed-to-seed spread (the standard deviation
of the fault-free losses): a difference well inside that spread is no measurable loss of accuracy. Training loss
is no fair comparison (after a failure the groups' streams are at other positions). Prints a table, writes
bench/results/convergence.json::

    .venv/bin/python bench/bench_convergence.py --seeds 0 1 2 --steps 600

``--smoke``: the fault-free runs of 2 seeds, 20 steps each, 2 groups of one rank (tests/integration/test_bench_smoke.py
runs it: the bench's own path, not a figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARSH = "kill:at=step60:group=b,kill:at=step180:group=c,hang:at=step260:group=a:for=3s,kill:at=step340:group=a"
SCHEDULES = {  # name -> (--chaos, recipe overrides)
    "fault-free": ("", ()),
    "demo": ("kill:at=step80:group=b", ()),
    "harsh": (HARSH, ()),
    "harsh+kgb": (HARSH, ("ft.keep_global_batch=true", "ft.lr_scaling=none")),
}


GROUP_FIELDS = ("status", "final_step", "restarts", "exit_codes", "discarded", "catch_ups", "params_sha256")
REPORT_FIELDS = ("diverged", "unfinished", "lost_steps", "discarded_steps", "recoveries", "quorum_waits", "timeline",
                 "val_losses")
"""Kept per run in the JSON besides the figures: what says why a run did not end with identical parameters."""

SMOKE_TOPOLOGY = ("launch.replicas=2", "launch.shard_count=1")
"""The smoke's groups: a third of the recipe's processes (each one's start-up dominates a 20-step run)."""


def run(seed: int, steps: int, chaos: str, overrides: tuple[str, ...], out: Path) -> dict[str, object]:
    """One launch; its report (raises with the launcher's output unless the job reached ``steps``: a group still
    restarting when the others finish is abandoned, which makes the launch exit 1 but leaves a valid job)."""
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "tiny_gpt.yaml"),
           f"trainer.seed={seed}", f"trainer.max_steps={steps}", f"trainer.val_every_n_steps={steps // 4}",
           *overrides, "--chaos", chaos, "--out", str(out), "--no-live"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    report_path = out / "report.json"
    report: dict[str, object] = json.loads(report_path.read_text()) if report_path.exists() else {}
    if report.get("committed_steps") != steps:
        raise RuntimeError(f"launch failed (seed {seed}, chaos {chaos!r}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES),
                        help="which schedules to run (fault-free is always run: it is the baseline)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "convergence.json",
                        help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run for CI: the fault-free runs of 2 seeds, 20 steps each, 2 one-rank groups")
    args = parser.parse_args()
    topology: tuple[str, ...] = ()
    if args.smoke:
        args.seeds, args.steps, args.schedules, topology = [0, 1], 20, ["fault-free"], SMOKE_TOPOLOGY
    names = ["fault-free", *(n for n in args.schedules if n != "fault-free")]
    if len(args.seeds) < 2:
        parser.error(f"--seeds needs at least 2 seeds for a seed-to-seed spread, got {args.seeds}")

    runs: dict[str, dict[int, dict[str, object]]] = {name: {} for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in names:
                chaos, overrides = SCHEDULES[name]
                report = run(seed, args.steps, chaos, (*topology, *overrides), Path(tmp) / f"{name}-{seed}")
                val = report["val_loss"]
                assert isinstance(val, dict) and val["step"] == args.steps, f"no validation at the last step: {val}"
                groups = report["groups"]
                assert isinstance(groups, dict)
                runs[name][seed] = {"val_loss": val["final"], "failures": report["failures_injected"],
                                    "identical": report["final_params_identical"],
                                    "abandoned": [g for g, d in groups.items() if d["status"] == "abandoned"],
                                    "effective_training_time": report["effective_training_time"],
                                    # What a run that did not end identical needs to be understood by: its launch
                                    # folder is gone with the temporary directory.
                                    "groups": {g: {k: d[k] for k in GROUP_FIELDS} for g, d in groups.items()},
                                    **{k: report[k] for k in REPORT_FIELDS}}
                print(f"seed {seed} {name:<10} val_loss {val['final']:.4f}  failures {report['failures_injected']}  "
                      f"identical {report['final_params_identical']}  abandoned {runs[name][seed]['abandoned']}",
                      flush=True)

    baseline = [runs["fault-free"][s]["val_loss"] for s in args.seeds]
    spread = statistics.stdev(baseline)
    summary = {}
    print(f"\n{'schedule':<12} {'failures':>8} {'val loss mean':>14} {'paired diff':>12} {'diff / spread':>14}")
    for name in names:
        losses = [runs[name][s]["val_loss"] for s in args.seeds]
        diffs = [loss - base for loss, base in zip(losses, baseline, strict=True)]
        mean_diff = statistics.fmean(diffs)
        failures = statistics.fmean(runs[name][s]["failures"] for s in args.seeds)
        summary[name] = {"val_loss_mean": statistics.fmean(losses), "paired_diff_mean": mean_diff,
                         "paired_diffs": diffs, "diff_over_spread": mean_diff / spread, "failures_mean": failures}
        print(f"{name:<12} {failures:>8.1f} {statistics.fmean(losses):>14.4f} {mean_diff:>+12.4f} "
              f"{mean_diff / spread:>+14.2f}")
    print(f"seed-to-seed spread of the fault-free runs (stdev over {len(args.seeds)} seeds): {spread:.4f}")
    result = {"recipe": "recipes/tiny_gpt.yaml", "steps": args.steps, "seeds": args.seeds,
              "schedules": {name: SCHEDULES[name] for name in names},
              "fault_free_spread": spread, "summary": summary, "runs": runs,
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
