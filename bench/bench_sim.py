"""Goodput simulator benchmark: speed of 30 simulated days at ~100K GPUs on one core, and Monte Carlo vs closed form.

Run: ``.venv/bin/python bench/bench_sim.py`` (prints two tables, writes bench/results/sim.json).
Speed is wall time of one trial of ``simulate`` (failure trace plus both policies); the goal is under 2 s.
``--smoke``: one timed trial per case and 2 trials of 2 days per agreement case (tests/integration/test_bench_smoke.py
runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from lightning_fthsdp.sim import PRESETS, SimConfig, closed_form
from lightning_fthsdp.sim.engine import simulate
from lightning_fthsdp.sim.output import format_table

RESULTS = Path(__file__).parent / "results" / "sim.json"
SPEED_REPEATS = 7
SPEED_GOAL_S = 2.0
AGREEMENT_DAYS, AGREEMENT_TRIALS, SEED = 30.0, 20, 0

PAPER = PRESETS["paper"]
SPEED_CASES: dict[str, dict[str, Any]] = {
    "paper preset, 98,304 GPUs": PAPER,
    "100,032 GPUs, 6.5/1k servers/day, 1 min saves": {"gpus": 100_032, "checkpoint_save_min": 1.0},
}
AGREEMENT_CASES: dict[str, dict[str, Any]] = {
    "paper": PAPER,
    "paper-rejoin": PRESETS["paper-rejoin"],
    "paper-projected": PRESETS["paper-projected"],
    "paper at 16,320 GPUs": {**PAPER, "mtbf_min": None, "gpus": 16_320},
    "paper, overlap=merge": {**PAPER, "overlap": "merge"},
    "paper, 1 min checkpoint saves": {**PAPER, "checkpoint_save_min": 1.0},
    "paper, min_replicas=11": {**PAPER, "min_replicas": 11},
    "paper, 2 spare groups": {**PAPER, "spare_groups": 2},
    "paper, 4 correlated/day x 3 groups": {**PAPER, "correlated_per_day": 4.0, "correlated_groups": 3},
}


def bench_speed(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, values in SPEED_CASES.items():
        cfg = SimConfig(**values)
        times = []
        for repeat in range(repeats):
            start = time.perf_counter()
            result = simulate(cfg, days=30.0, trials=1, seed=repeat)
            times.append(time.perf_counter() - start)
        rows.append({
            "case": name, "gpus": cfg.gpus, "failures_per_day": result.sync.failures_per_day,
            "median_s": statistics.median(times), "max_s": max(times), "goal_s": SPEED_GOAL_S,
            "meets_goal": max(times) < SPEED_GOAL_S,
        })
    return rows


def bench_agreement(days: float, trials: int) -> list[dict[str, Any]]:
    rows = []
    for name, values in AGREEMENT_CASES.items():
        cfg = SimConfig(**values)
        closed = closed_form(cfg)
        result = simulate(cfg, days=days, trials=trials, seed=SEED)
        for policy in ("sync", "fthsdp"):
            measured = getattr(result, policy)
            low, high = measured.ci95
            rows.append({
                "case": name, "policy": policy, "closed_form": getattr(closed, policy), "monte_carlo": measured.ett,
                "ci95_low": low, "ci95_high": high, "gap_points": 100 * (measured.ett - getattr(closed, policy)),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: one timed trial per case, 2 trials "
                                                             "of 2 days per agreement case")
    args = parser.parse_args()
    repeats, days, trials = (1, 2.0, 2) if args.smoke else (SPEED_REPEATS, AGREEMENT_DAYS, AGREEMENT_TRIALS)
    if hasattr(os, "sched_setaffinity"):  # one core, as the goal says
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    speed = bench_speed(repeats)
    agreement = bench_agreement(days, trials)
    print(f"speed: one trial (failure trace + both policies) of 30 simulated days, {repeats} runs on one core")
    print(format_table(speed))
    print(f"\nagreement: {trials} trials x {days:g} days, seed {SEED}")
    print(format_table(agreement))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "speed": speed,
        "agreement": {"days": days, "trials": trials, "seed": SEED, "rows": agreement},
    }, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
