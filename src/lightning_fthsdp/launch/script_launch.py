"""``fthsdp launch --script SCRIPT.py``: a user's script once per replica group on this machine, its job driven by the
recipe of ``--recipe``/``--set`` (``launch.job_args``) and the flags; the lighthouse, supervision, chaos and report are
``fthsdp launch``'s (``launch.cli.run_job``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.launch.commands import ScriptCommand
    from lightning_fthsdp.recipes.schema import RecipeConfig

BY = "fthsdp launch"


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.launch import chaos
    from lightning_fthsdp.launch.catalog import script_path
    from lightning_fthsdp.launch.cli import group_ids, hosts_available, run_job, write_report
    from lightning_fthsdp.launch.commands import ScriptCommand
    from lightning_fthsdp.launch.job_args import job_recipe, script_args
    from lightning_fthsdp.launch.run_folder import checkpoint_folder, prepare, resume_point, usable
    from lightning_fthsdp.recipes.loader import to_yaml

    try:
        if args.target_steps is not None and args.target_steps < 1:
            raise ValueError(f"--target-steps must be >= 1, got {args.target_steps}")
        recipe = job_recipe(args, BY)
        command = ScriptCommand(script_path(args.script).resolve(), script_args(args), recipe.launch.shard_count)
        replica_ids = group_ids(recipe.launch.replicas)
        faults = chaos.parse(recipe.launch.chaos, replica_ids, hosts=recipe.launch.hosts)
        if args.fresh and not recipe.ft.checkpoint_dir:
            raise ValueError("--fresh moves aside the checkpoints of the recipe's ft.checkpoint_dir, and this job has "
                             "none: give --recipe R.yaml or --set ft.checkpoint_dir=DIR (the folder the script "
                             "checkpoints to), or drop --fresh")
    except ValueError as err:  # a RecipeError too
        raise SystemExit(f"{BY}: error: {err}") from None
    if args.print_config:
        print(_config(command, args.target_steps, recipe), end="")
        return 0
    hosts_available(recipe)
    out = usable(args.out, BY)
    try:  # every refusal before the run's folder is touched
        if args.target_steps is not None:
            chaos.refuse_unreachable(faults, args.target_steps, "--target-steps")
        checkpoint_folder(recipe, out)
        resume = resume_point(recipe, args.fresh)
    except ValueError as err:
        raise SystemExit(f"{BY}: error: {err}") from None
    prepare(out, BY)
    (out / "recipe.yaml").write_text(to_yaml(recipe))
    meta = {"script": str(command.script), "script_args": list(command.args), "recipe": str(out / "recipe.yaml")}
    report = run_job(recipe, replica_ids, chaos.ChaosSchedule(faults, recipe.launch.chaos_seed), out, args.live,
                     command, args.target_steps, meta, resume=resume)
    return write_report(report, out)


def _config(command: ScriptCommand, target_steps: int | None, recipe: RecipeConfig) -> str:
    """``--print-config``: what the launcher runs (YAML). Of the recipe, the sections that apply to a script."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({"script": str(command.script), "script_args": list(command.args),
                              "target_steps": target_steps, "trainer": {"accelerator": recipe.trainer.accelerator},
                              "launch": dataclasses.asdict(recipe.launch), "ft": dataclasses.asdict(recipe.ft)})
