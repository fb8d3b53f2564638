"""Every check of a recipe job's start, in one place: ``fthsdp launch`` runs them before it starts a job, and a sweep
(``fthsdp launch -m``, ``launch.multirun``) runs them for every job before its first starts, so a job the launch
would refuse is refused before any trains.

``composed``: the recipe with its overrides and flags, its groups, its chaos faults, its classes (what
``--print-config`` shows); ``startable``: what a start in the run's folder needs (hosts, the folder's rules, a chaos
step the job reaches, the checkpoint folder and what it resumes from). Each refusal is a ``SystemExit`` naming the
value and the fix.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.launch.chaos import Fault
    from lightning_fthsdp.recipes.schema import RecipeConfig
    from lightning_fthsdp.recovery.checkpoint import CheckpointInfo


def composed(args: argparse.Namespace, by: str) -> tuple[RecipeConfig, list[str], list[Fault]]:
    """The recipe job of ``args`` (``launch.job_args.job_recipe``), its replica group ids and its chaos faults, its
    model and data classes verified (a class or argument that does not fit fails here, not in the groups); ``by``:
    the command, for the messages."""
    from lightning_fthsdp.launch import chaos
    from lightning_fthsdp.launch.cli import group_ids
    from lightning_fthsdp.launch.job_args import job_recipe
    from lightning_fthsdp.recipes import components

    if args.target_steps is not None:
        raise SystemExit(f"{by}: error: --target-steps is for --script; a recipe's is trainer.max_steps")
    try:  # a RecipeError is a ValueError
        recipe = job_recipe(args, by)
        replica_ids = group_ids(recipe.launch.replicas)
        faults = chaos.parse(recipe.launch.chaos, replica_ids, hosts=recipe.launch.hosts)
        components.verify(recipe.model, recipe.data)
    except ValueError as err:
        raise SystemExit(f"{by}: error: {err}") from None
    return recipe, replica_ids, faults


def startable(args: argparse.Namespace, recipe: RecipeConfig, faults: list[Fault], by: str, *,
              dry_run: bool = False) -> tuple[Path, CheckpointInfo | None]:
    """Every refusal of starting ``recipe`` in ``args.out``, before anything there is touched; the run's folder
    (absolute) and the checkpoint the job resumes from. ``recipe.ft.checkpoint_dir`` becomes its path in the run's
    folder. ``dry_run`` (a sweep's pre-check): ``--fresh`` moves no checkpoint yet (it refuses none either)."""
    from lightning_fthsdp.launch import chaos
    from lightning_fthsdp.launch.cli import hosts_available
    from lightning_fthsdp.launch.run_folder import checkpoint_folder, resume_point, usable

    hosts_available(recipe)
    out = usable(args.out, by)
    try:
        chaos.refuse_unreachable(faults, recipe.trainer.max_steps, "trainer.max_steps")
        checkpoint_folder(recipe, out)
        resume = None if dry_run and args.fresh else resume_point(recipe, args.fresh)
    except ValueError as err:
        raise SystemExit(f"{by}: error: {err}") from None
    return out, resume
