"""``python -m lightning_fthsdp.slurm.supervise OUT --nodes-per-replica M``: the job inside its SLURM allocation.

What the sbatch script of ``fthsdp slurm`` runs on the batch node: the launcher's job loop
(``lightning_fthsdp.launch.cli.run_job``: lighthouse, supervised groups with a restart budget per group, the report)
with a ``SlurmPlacement`` (every process a job step). The recipe is ``OUT/recipe.yaml`` as ``fthsdp slurm`` resolved it;
with ``--script``, ``OUT/script.json`` names the script each group's step runs instead of ``fthsdp fit``. The report
goes to ``OUT/report.json`` with a ``slurm`` field (each incarnation's step id and nodes). A start (the
first, or a requeue) resumes from the newest complete durable checkpoint in ``ft.checkpoint_dir``. Exit code 0 when
every group reached ``trainer.max_steps`` with identical final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ENV_JOB_ID, ENV_NODELIST, ENV_BATCH_NODE = "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURMD_NODENAME"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fthsdp.slurm.supervise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the run's folder (on a file system every node shares)")
    parser.add_argument("--nodes-per-replica", type=int, required=True)
    args = parser.parse_args(argv)
    missing = [name for name in (ENV_JOB_ID, ENV_NODELIST, ENV_BATCH_NODE) if not os.environ.get(name)]
    if missing:
        raise SystemExit(f"{parser.prog}: ${', $'.join(missing)} unset: run it inside a SLURM allocation (the sbatch "
                         f"script that fthsdp slurm writes does)")
    from lightning_fthsdp.launch import chaos
    from lightning_fthsdp.launch.cli import group_ids, run_job, write_report
    from lightning_fthsdp.launch.run_folder import prepare, resume_point
    from lightning_fthsdp.recipes.loader import load_recipe
    from lightning_fthsdp.slurm.cli import SCRIPT_FILE, group_command
    from lightning_fthsdp.slurm.placement import SlurmPlacement

    out = args.out.resolve()
    recipe = load_recipe(out / "recipe.yaml", [])
    # Also a requeue (scontrol requeue, --requeue after a node failure or preemption) or a resubmission: the newest
    # complete checkpoint is the job's state; the previous attempt's records would mix with this one's.
    try:
        resume = resume_point(recipe, fresh=False)
    except ValueError as err:
        raise SystemExit(f"{parser.prog}: error: {err}") from None
    prepare(out, "fthsdp slurm")
    replica_ids = group_ids(recipe.launch.replicas)
    placement = SlurmPlacement.from_allocation(
        os.environ[ENV_JOB_ID], os.environ[ENV_BATCH_NODE], os.environ[ENV_NODELIST], replica_ids,
        args.nodes_per_replica, recipe.launch.shard_count // args.nodes_per_replica,
        gpus=recipe.trainer.accelerator != "cpu")
    print(f"fthsdp slurm: job {placement.job_id}: groups on {placement.pool.assigned}, spares "
          f"{placement.pool.spares}", flush=True)
    script_job = json.loads((out / SCRIPT_FILE).read_text()) if (out / SCRIPT_FILE).exists() else None
    command = group_command(out, script_job)
    # A script's target is its own (the report takes the highest step a group ended at); a recipe's is max_steps.
    target, meta = ((None, {"script": script_job["script"], "script_args": script_job["args"]}) if script_job
                    else (recipe.trainer.max_steps, {"recipe": str(out / "recipe.yaml")}))
    report = run_job(recipe, replica_ids, chaos.ChaosSchedule([], 0), out, False, command, target, meta,
                     placement=placement, restart_lighthouse=True, resume=resume)
    report["slurm"] = placement.summary()
    return write_report(report, out)


if __name__ == "__main__":
    sys.exit(main())
