"""The anatomy of a restart against its floor, on the Lightning path and the plain loop.

For each path, in the same run on this machine:

- floor: the same recipe started once with no failure and no fault tolerance (``fthsdp fit --no-ft``: Lightning's
  own strategy; ``train_plain --no-ft``: no lighthouse, no ``FTManager``), from the process start to its first
  committed step;
- restart: a job of ``--replicas`` groups with a lighthouse, group b killed (SIGKILL) at ``--kill-at`` and started
  again at once (Lightning: by ``fthsdp launch``, whose ``launch.restart_delay_s`` is set to 0; plain: by this
  script), from the new process's start to its first trained step, split into its phases
  (``lightning_fthsdp.config.anatomy``);
- standby (Lightning): the same with ``launch.standby`` (b's next incarnation started and imported ahead), from its
  release to its first trained step.

``ratio`` = restart / floor (the target is <= 1.5). The restart competes for the CPU with the groups that keep
training, the floor has the machine to itself (minus whatever else runs): on a loaded host the ratio is pessimistic.
Prints a table, writes bench/results/restart.json::

    .venv/bin/python bench/bench_restart.py                      # both paths, recipes/mlp.yaml
    .venv/bin/python bench/bench_restart.py --path lightning --recipe recipes/tiny_gpt.yaml --shard-count 2

``--smoke``: the plain path, b killed at step 30 of 400 (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_fthsdp.config.anatomy import PHASES, phases
from lightning_fthsdp.launch.processes import PLAIN_TRAINER, Job, wait_for
from lightning_fthsdp.protocol.records import read_records

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _phases_record(jsonl: Path, after: float = 0.0) -> dict[str, Any] | None:
    found = [r for r in read_records(jsonl) if r["event"] == "phases" and r.get("rank", 0) == 0
             and r["milestones"].get("spawned", 0.0) > after]
    return found[-1] if found else None


def _row(path: str, run: str, marks: dict[str, float], **extra: Any) -> dict[str, Any]:
    split = phases(marks)
    return {"path": path, "run": run, "phases": split, "total_s": round(sum(split.values()), 3), **extra}


def lightning_floor(recipe: Path, shard_count: int, workdir: Path) -> dict[str, Any]:
    jsonl = workdir / "floor-lightning.jsonl"
    job = Job(workdir)
    try:
        cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "fit", "--config", str(recipe), "--record", str(jsonl),
               "--no-ft", f"launch.shard_count={shard_count}", "trainer.max_steps=3", "--",
               "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
               "--trainer.enable_checkpointing=false",
               f"--trainer.default_root_dir={workdir / 'lightning'}"]
        group = job.start_command("floor", cmd, jsonl=jsonl, log=workdir / "floor-lightning.log",
                                  env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
        job.wait_exit(group, 600)
    finally:
        job.close()
    record = _phases_record(jsonl)
    assert record is not None, f"the floor run wrote no phases record: {(workdir / 'floor-lightning.log').read_text()}"
    return _row("lightning", "floor", record["milestones"])


def lightning_restart(recipe: Path, shard_count: int, replicas: int, kill_at: int, steps: int, step_s: float,
                      standby: bool, workdir: Path) -> dict[str, Any]:
    out = workdir / f"launch-{'standby' if standby else 'bare'}"
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(recipe), f"trainer.max_steps={steps}",
           f"trainer.min_step_time_s={step_s}", "launch.restart_delay_s=0", "trainer.val_every_n_steps=0",
           f"launch.standby={str(standby).lower()}",
           "--replicas", str(replicas), "--shard-count", str(shard_count),
           "--chaos", f"kill:at=step{kill_at}:group=b", "--out", str(out), "--no-live"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:  # SIGTERM: the launcher ends the groups it started
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    report = json.loads((out / "report.json").read_text())
    restarts = report["restart_phases"]
    assert restarts, f"group b never trained again after its restart:\n{output[-3000:]}"
    first = restarts[0]
    recovery = next((r["recovery_s"] for r in report["recoveries"] if r["replica_id"] == "b"), None)
    return {"path": "lightning", "run": "standby" if standby else "restart", "phases": first["phases"],
            "total_s": first["total_s"], "ahead_s": first["ahead_s"], "standby": first["standby"],
            "wait_s": first["wait_s"], "caught_up": first["caught_up"], "kill_to_training_s": recovery,
            "finished": report["final_params_identical"] and not report["unfinished"]}


def plain_floor(workdir: Path, step_ms: int) -> dict[str, Any]:
    jsonl = workdir / "floor-plain.jsonl"
    job = Job(workdir)
    try:
        cmd = [sys.executable, "-m", PLAIN_TRAINER, "--no-ft", "--steps", "3", "--step-time-ms", str(step_ms),
               "--log-jsonl", str(jsonl)]
        job.wait_exit(job.start_command("floor", cmd, jsonl=jsonl, log=workdir / "floor-plain.log"), 300)
    finally:
        job.close()
    record = _phases_record(jsonl)
    assert record is not None, f"the floor run wrote no phases record: {(workdir / 'floor-plain.log').read_text()}"
    return _row("plain", "floor", record["milestones"])


def plain_restart(replicas: int, kill_at: int, steps: int, step_ms: int, workdir: Path) -> dict[str, Any]:
    job = Job(workdir / "plain", min_replicas=1)
    job.workdir.mkdir(parents=True, exist_ok=True)
    ids = [chr(ord("a") + i) for i in range(replicas)]
    try:
        job.start_lighthouse()
        groups = {r: job.start_group(r, steps, step_time_ms=step_ms) for r in ids}
        wait_for(lambda: groups["b"].last_step() >= kill_at, 300, f"b to commit step {kill_at}")
        os.killpg(groups["b"].proc.pid, signal.SIGKILL)
        groups["b"].proc.wait(timeout=30)
        killed = time.time()
        job.start_group("b", steps, step_time_ms=step_ms)
        record = wait_for(lambda: _phases_record(groups["b"].jsonl, after=killed), 300,
                          "the restarted b to train a step")
        first_trained = record["t"]
    finally:
        job.close()
    return _row("plain", "restart", record["milestones"], wait_s=round(record["milestones"]["spawned"] - killed, 3),
                caught_up="fetched" in record["milestones"], kill_to_training_s=round(first_trained - killed, 3))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'path':<10} {'run':<8} " + " ".join(f"{p:>8.8}" for p in PHASES) + f" {'total':>7} {'ratio':>6}"
          f" {'kill->train':>11}")
    for row in rows:
        ratio = f"{row['ratio']:>6.2f}" if "ratio" in row else f"{'':>6}"
        kill = f"{row['kill_to_training_s']:>11.2f}" if row.get("kill_to_training_s") is not None else f"{'':>11}"
        print(f"{row['path']:<10} {row['run']:<8} " + " ".join(f"{row['phases'].get(p, 0.0):>8.2f}" for p in PHASES)
              + f" {row['total_s']:>7.2f} {ratio} {kill}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("lightning", "plain", "both"), default="both")
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "mlp.yaml", help="Lightning path recipe")
    parser.add_argument("--shard-count", type=int, default=1, help="ranks per group on the Lightning path")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=300,
                        help="kill group b once it committed this step (late enough for its standby to be ready)")
    parser.add_argument("--steps", type=int, default=800, help="steps of the job (enough to outlast a restart)")
    parser.add_argument("--standby", choices=("on", "off", "both"), default="both",
                        help="Lightning path: restart with launch.standby (a next incarnation imported ahead), "
                             "without (a bare process), or both")
    parser.add_argument("--step-ms", type=int, default=50, help="pace of a step (both paths)")
    parser.add_argument("--repeats", type=int, default=1, help="floor and restart pairs per path (median ratio)")
    parser.add_argument("--out", type=Path, default=RESULTS / "restart.json", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: the plain path, b killed at step "
                                                             "30 of 400")
    args = parser.parse_args()
    if args.smoke:
        args.path, args.kill_at, args.steps = "plain", 30, 400
    rows: list[dict[str, Any]] = []
    paths = ("lightning", "plain") if args.path == "both" else (args.path,)
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        for repeat in range(args.repeats):
            for path in paths:
                workdir = Path(tmp) / f"{path}-{repeat}"
                workdir.mkdir()
                if path == "lightning":
                    floor = lightning_floor(args.recipe.resolve(), args.shard_count, workdir)
                    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.standby]
                    restarts = [lightning_restart(args.recipe.resolve(), args.shard_count, args.replicas,
                                                  args.kill_at, args.steps, args.step_ms / 1000, standby, workdir)
                                for standby in modes]
                else:
                    floor = plain_floor(workdir, args.step_ms)
                    restarts = [plain_restart(args.replicas, args.kill_at, args.steps, args.step_ms, workdir)]
                for restart in restarts:
                    restart["ratio"] = round(restart["total_s"] / floor["total_s"], 3)
                    ratios.setdefault(f"{path} {restart['run']}", []).append(restart["ratio"])
                rows += [floor, *restarts]
    _print(rows)
    summary = {p: statistics.median(v) for p, v in ratios.items()}
    for path, ratio in summary.items():
        print(f"{path}: {ratio:.2f} x the floor (median of {len(ratios[path])}; target <= 1.5)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"recipe": str(args.recipe), "shard_count": args.shard_count, "replicas": args.replicas,
              "kill_at": args.kill_at, "step_ms": args.step_ms, "rows": rows, "median_ratio": summary,
              "target": 1.5, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
