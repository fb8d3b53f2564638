"""What the cluster front ends (``fthsdp slurm``, ``fthsdp k8s``) share: the recipe or a script, the job's shape on
the command line, and how a group's ranks spread over its nodes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.recipes.schema import RecipeConfig


def add_job_arguments(parser: argparse.ArgumentParser, node: str) -> None:
    """RECIPE (or ``--script``), its overrides, ``--replicas``, ``--shard-count`` and ``--nodes-per-replica``
    (``node``: what the cluster calls a node)."""
    parser.add_argument("recipe", type=Path, nargs="?", metavar="RECIPE.yaml",
                        help="an omegaconf recipe (recipes/*.yaml); with --script, the script's first argument")
    parser.add_argument("overrides", nargs="*", metavar="group=option | key=value",
                        help="config group choices and recipe overrides, e.g. trainer.max_steps=50; with --script, "
                             "the script's arguments (after --)")
    parser.add_argument("--script", type=Path, default=None, metavar="SCRIPT.py",
                        help="run this script per replica group instead of a recipe (Lightning with "
                             "strategy='fthsdp', Accelerate with the helper, plain PyTorch), under torchrun with its "
                             "arguments after --, as fthsdp launch --script does")
    parser.add_argument("--replicas", type=int, default=None, help="replica groups (default: launch.replicas)")
    parser.add_argument("--shard-count", type=int, default=None,
                        help=f"shard ranks per replica group over all its {node}s (default: launch.shard_count)")
    parser.add_argument("--nodes-per-replica", type=int, default=1, help=f"{node}s of each replica group (default 1)")


def job_recipe(args: argparse.Namespace, *extra: str) -> RecipeConfig:
    """The job's recipe: the named one with its overrides, the flags and ``extra`` overrides; with ``--script``, the
    schema's defaults (a script configures its own training; the ``launch`` and ``ft`` sections drive the lighthouse
    and the restarts) with the flags. RecipeError / ValueError naming the fix."""
    from lightning_fthsdp.launch.catalog import recipe_path
    from lightning_fthsdp.recipes.loader import load_recipe
    from lightning_fthsdp.recipes.schema import RecipeConfig

    flags = [f"launch.{key}={json.dumps(value)}" for key, value in
             (("replicas", args.replicas), ("shard_count", args.shard_count)) if value is not None]
    if args.script is None:
        if args.recipe is None:
            raise ValueError("give a RECIPE.yaml, or --script SCRIPT.py")
        return load_recipe(recipe_path(args.recipe), [*args.overrides, *flags, *extra])
    for flag, value in (("--replicas", args.replicas), ("--shard-count", args.shard_count)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    recipe = RecipeConfig()
    recipe.launch.replicas = args.replicas or recipe.launch.replicas
    recipe.launch.shard_count = args.shard_count or recipe.launch.shard_count
    recipe.launch.standby = False
    return recipe


def script_args(args: argparse.Namespace) -> list[str]:
    """With ``--script``: the script's arguments (the positionals are the script's, as for ``fthsdp launch``)."""
    return ([str(args.recipe)] if args.recipe is not None else []) + list(args.overrides)


def ranks_per_node(shard_count: int, nodes_per_replica: int, node: str) -> int:
    """The ranks each node of a group runs; ValueError naming the fix when the nodes do not divide the group."""
    if nodes_per_replica < 1 or shard_count % nodes_per_replica:
        whole = max(1, nodes_per_replica) * max(1, shard_count // max(1, nodes_per_replica))
        raise ValueError(f"--nodes-per-replica {nodes_per_replica} must be >= 1 and divide launch.shard_count="
                         f"{shard_count} (the ranks of a group over all its {node}s): set launch.shard_count={whole} "
                         f"or change the {node}s")
    return shard_count // nodes_per_replica


def refuse_one_advertise_host(advertise_host: str, node: str, default: str) -> None:
    """A recipe's ``ft.advertise_host`` would be every node's advertised address (an explicit value wins over the
    per-node environment): refused, naming the per-node ``default`` that applies without it."""
    if advertise_host:
        raise ValueError(f"ft.advertise_host={advertise_host!r} would be the advertised address of every {node} of the "
                         f"job, while each must advertise its own ({default}): set ft.advertise_host=''")


def refuse_chaos(chaos: str, how: str) -> None:
    """``launch.chaos`` is ``fthsdp launch``'s failure injection: a cluster job refuses it, naming ``how`` to inject
    failures there."""
    if chaos:
        raise ValueError(f"launch.chaos={chaos!r} is fthsdp launch's: {how}; set launch.chaos=''")
