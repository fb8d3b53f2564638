"""``fthsdp slurm``: a fault-tolerant job from a recipe in one SLURM allocation (docs/slurm.md).

Writes ``OUT/recipe.yaml`` (the resolved recipe) and ``OUT/job.sbatch``, and submits the script with ``sbatch``
(``--dry-run``: prints it, with the step each group's first incarnation runs, and submits nothing; ``--wait``: waits
for the job to end and prints its summary). The allocation has ``--replicas x --nodes-per-replica + --spares`` nodes;
the lighthouse runs as its own step, each replica group as one step of torchrun over its nodes, and a supervisor in the
allocation restarts only a failed group's step (within ``launch.max_restarts`` per ``launch.restart_window_s``), on
spare nodes when its own are lost. ``OUT`` must be on a file system every node shares. Group choices and overrides
come after the recipe, as for ``fthsdp launch``; ``launch.shard_count`` (``--shard-count``) is the ranks of a group
over all its nodes. ``--script SCRIPT.py`` runs that script (its arguments after ``--``) under torchrun in every group's
step instead of ``fthsdp fit`` of a recipe, as ``fthsdp launch --script`` does on one machine; ``--recipe R.yaml``
with ``--set key=value`` gives its job's trainer (GPUs), ft and launch settings (``launch.job_args``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_fthsdp.launch.cluster_args import (
    add_job_arguments,
    ranks_per_node,
    refuse_chaos,
    refuse_one_advertise_host,
)
from lightning_fthsdp.launch.job_args import job_recipe, script_args

if TYPE_CHECKING:
    from lightning_fthsdp.launch.commands import GroupCommand
    from lightning_fthsdp.slurm.script import SbatchScript

#: With ``--script``: the script and its arguments, beside ``recipe.yaml`` in the run's folder (``slurm.supervise``).
SCRIPT_FILE = "script.json"

EXTRAS = ("launch", "lightning", "sim")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "slurm", help="submit a recipe as a fault-tolerant SLURM job: groups as steps, restarts, spares, report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(parser, node="node")
    parser.add_argument("--spares", type=int, default=0,
                        help="extra nodes in the allocation that a group on a lost node moves to (default 0)")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                        help="an extra #SBATCH option, e.g. --sbatch=--partition=gpu --sbatch=--time=2-00:00:00")
    parser.add_argument("--out", type=Path, default=Path("runs/slurm"),
                        help="the run's folder on a shared file system (default: runs/slurm)")
    parser.add_argument("--fresh", action="store_true",
                        help="start at step 0 although ft.checkpoint_dir holds checkpoints: they are moved aside "
                             "(CHECKPOINT_DIR/previous-TIME/), not deleted (default: the job, and every requeue of it, "
                             "resumes from the newest complete one)")
    parser.add_argument("--dry-run", action="store_true", help="print the script and the group steps; submit nothing")
    parser.add_argument("--wait", action="store_true", help="wait for the job to end and print its summary")
    parser.set_defaults(func=run, extras=EXTRAS)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.launch.cli import group_ids
    from lightning_fthsdp.launch.run_folder import checkpoint_folder, prepare, resume_point, usable
    from lightning_fthsdp.recipes import components
    from lightning_fthsdp.recipes.loader import RecipeError, to_yaml
    from lightning_fthsdp.slurm.script import SbatchScript

    try:
        # A standby is a process on this machine; a step is started fresh.
        recipe = job_recipe(args, "fthsdp slurm", "launch.standby=false")
        per_replica = args.nodes_per_replica
        ranks = ranks_per_node(recipe.launch.shard_count, per_replica, node="node")
        refuse_one_advertise_host(recipe.ft.advertise_host, "node",
                                  "by default its local address on the route to the lighthouse")
        refuse_chaos(recipe.launch.chaos, "on SLURM inject failures with scancel --signal=KILL JOB.STEP or scontrol "
                                          "update nodename=N state=down")
        if args.script is not None and not args.script.is_file():
            raise ValueError(f"--script {args.script}: no such file (on a file system every node shares)")
        if args.script is None:  # the nodes share this installation: what fails here would fail in every group
            components.verify(recipe.model, recipe.data)
        script = SbatchScript(args.out.resolve(), recipe.launch.replicas, per_replica, args.spares,
                              ranks, recipe.trainer.accelerator != "cpu", sys.executable,
                              sbatch_args=tuple(args.sbatch))
        replica_ids = group_ids(recipe.launch.replicas)
    except (RecipeError, ValueError) as err:
        raise SystemExit(f"fthsdp slurm: error: {err}") from None
    if args.dry_run:
        print(script.text(), end="")
        print(_planned_steps(script, replica_ids, group_command(args.out.resolve(), _script_job(args))), end="")
        return 0
    out = usable(args.out, "fthsdp slurm")
    try:  # the supervisor resumes from the newest checkpoint when the job starts (and at every requeue)
        checkpoint_folder(recipe, out)
        resume = resume_point(recipe, args.fresh)
    except ValueError as err:
        raise SystemExit(f"fthsdp slurm: error: {err}") from None
    if resume is not None:
        print(f"fthsdp slurm: {recipe.ft.checkpoint_dir} holds the checkpoint of step {resume.step}: the job resumes "
              f"from its newest complete checkpoint when it starts (--fresh starts at step 0)", flush=True)
    prepare(out, "fthsdp slurm")
    (out / "recipe.yaml").write_text(to_yaml(recipe))
    (out / SCRIPT_FILE).unlink(missing_ok=True)
    if args.script is not None:
        (out / SCRIPT_FILE).write_text(json.dumps(_script_job(args)) + "\n")
    (out / "report.json").unlink(missing_ok=True)
    path = out / "job.sbatch"
    path.write_text(script.text())
    submit = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(path)]
    print(f"fthsdp slurm: {shlex.join(submit)}", flush=True)
    if shutil.which("sbatch") is None:
        raise SystemExit(f"fthsdp slurm: error: no sbatch on PATH: run it where SLURM's client is installed (the "
                         f"script is written: {path}), or pass --dry-run to print it")
    if not args.wait:
        done = subprocess.run(submit, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"fthsdp slurm: sbatch exited {done.returncode}: {done.stderr.strip()}")
        job_id = done.stdout.strip().split(";")[0]
        print(f"fthsdp slurm: submitted job {job_id}; its output: {out / f'slurm-{job_id}.out'}, report at the end: "
              f"{out / 'report.json'}")
        return 0
    code = subprocess.run(submit).returncode
    return _print_report(out, code)


def _print_report(out: Path, code: int) -> int:
    """After ``--wait``: the job's summary (as fthsdp launch prints it) and its exit code."""
    from lightning_fthsdp.launch.cli import summary

    report_path = out / "report.json"
    if not report_path.exists():
        print(f"fthsdp slurm: the job ended ({code}) without a report: see {out}/slurm-*.out", file=sys.stderr)
        return code or 1
    report = json.loads(report_path.read_text())
    summary(report, out)
    print(f"  lighthouse restarts: {report['lighthouse_restarts']}")
    for replica_id, runs in report["slurm"]["steps"].items():
        where = "; ".join(f"{r['step'] or r['name']} on {','.join(r['nodes'])}" for r in runs)
        print(f"  group {replica_id} steps: {where}")
    return code


def _script_job(args: argparse.Namespace) -> dict[str, Any] | None:
    """What ``SCRIPT_FILE`` holds with ``--script`` (None without)."""
    if args.script is None:
        return None
    return {"script": str(args.script.resolve()), "args": list(script_args(args))}


def group_command(out: Path, script_job: dict[str, Any] | None) -> GroupCommand:
    """What each group's step runs: ``fthsdp fit`` of ``OUT/recipe.yaml``, or the script of ``script_job`` (one
    process per rank: torchrun in the step starts the group's ranks)."""
    from lightning_fthsdp.launch.commands import FitCommand, ScriptCommand

    if script_job is None:
        return FitCommand(out / "recipe.yaml", out, standby=False)
    return ScriptCommand(Path(script_job["script"]), tuple(script_job["args"]))


def _planned_steps(script: SbatchScript, replica_ids: list[str], command: GroupCommand) -> str:
    """The step of every group's first incarnation, on placeholder nodes (the real names come with the allocation)."""
    from lightning_fthsdp.slurm.placement import group_step, lighthouse_step

    per = script.nodes_per_replica
    nodes = [f"NODE{i}" for i in range(1, script.nodes + 1)]
    lines = ["# The supervisor's steps (first incarnations; NODEi: the allocation's i-th node, RDZV_PORT: a free "
             "port):", "# lighthouse: " + shlex.join([*lighthouse_step(nodes[0], script.gpus), "python", "-m",
                                                     "lightning_fthsdp.cli", "lighthouse", "..."])]
    for i, replica_id in enumerate(replica_ids):
        group_nodes = nodes[i * per:(i + 1) * per]
        argv = group_step(group_nodes, step_name=f"fthsdp-{replica_id}.0", rdzv_endpoint=f"{group_nodes[0]}:RDZV_PORT",
                          rdzv_id=f"JOB-{replica_id}-0", ranks_per_node=script.ranks_per_node, gpus=script.gpus,
                          argv=command.argv(script.out / "groups" / f"{replica_id}.0.jsonl"))
        lines.append(f"# group {replica_id}: " + shlex.join(argv))
    if script.spares:
        lines.append(f"# spares: {', '.join(nodes[len(replica_ids) * per:])}")
    return "\n".join(lines) + "\n"
