"""What every front end (``fthsdp launch``, ``fthsdp slurm``, ``fthsdp k8s``) reads the same way: a job is a recipe
(``RECIPE.yaml`` with its overrides after it) or a user's script (``--script``, the positionals its arguments), and its
recipe (the flags applied) drives the lighthouse, the restarts and the groups' devices.

A script configures its own training, so the positionals cannot carry recipe overrides: a script's recipe is
``--recipe R.yaml`` (default: the schema's defaults) with ``--set key=value`` overrides. Its ``trainer``, ``ft`` and
``launch`` sections apply (``trainer.accelerator``: GPUs per group; ``ft``: the lighthouse's values and the
checkpoint folder the job resumes from; ``launch``: replicas, shard count, restarts, timeouts); its ``model`` and
``data`` are the script's own business and are ignored, with a note.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.recipes.schema import RecipeConfig

#: Flags that set a recipe key, where a front end has them (attribute of the parsed arguments, key).
FLAG_KEYS = (("replicas", "launch.replicas"), ("shard_count", "launch.shard_count"), ("chaos", "launch.chaos"),
             ("hosts", "launch.hosts"))


def add_arguments(parser: argparse.ArgumentParser, script_help: str) -> None:
    """RECIPE.yaml and its overrides, or ``--script`` (``script_help``: how this front end runs it) with ``--recipe``
    and ``--set``."""
    parser.add_argument("recipe", type=Path, nargs="?", metavar="RECIPE.yaml",
                        help="an omegaconf recipe (recipes/*.yaml); with --script, the script's first argument (its "
                             "recipe is --recipe)")
    parser.add_argument("overrides", nargs="*", metavar="group=option | key=value",
                        help="config group choices and recipe overrides, e.g. model=mlp trainer.max_steps=50; with "
                             "--script, the script's arguments (after --; the recipe's overrides are --set)")
    parser.add_argument("--script", type=Path, default=None, metavar="SCRIPT.py", help=script_help)
    parser.add_argument("--recipe", type=Path, default=None, dest="script_recipe", metavar="RECIPE.yaml",
                        help="with --script: the recipe whose trainer (accelerator: GPUs), ft and launch sections "
                             "drive the job (its model and data are ignored: the script builds its own); default: the "
                             "schema's defaults")
    parser.add_argument("--set", action="append", default=[], dest="settings", metavar="key=value",
                        help="with --script: an override of its recipe, e.g. --set ft.min_replicas=2 (repeatable)")


def job_recipe(args: argparse.Namespace, by: str, *extra: str) -> RecipeConfig:
    """The job's recipe: RECIPE.yaml with its overrides, or with ``--script`` the ``--recipe`` (schema defaults
    without) with its ``--set`` overrides and ``launch.standby=false`` (a script is started bare); then the flags of
    ``FLAG_KEYS`` the front end has, then ``extra`` overrides. ``by``: the front end, for the note on a script's
    ignored model and data. RecipeError / ValueError naming the fix."""
    from lightning_fthsdp.launch.catalog import recipe_path
    from lightning_fthsdp.recipes.loader import load_recipe

    flags = [f"{key}={json.dumps(getattr(args, name))}" for name, key in FLAG_KEYS
             if getattr(args, name, None) is not None]  # a JSON scalar is YAML: the chaos spec stays a string
    if args.script is None:
        if args.script_recipe is not None or args.settings:
            raise ValueError("--recipe and --set are for --script: a recipe job names its recipe first and its "
                             "overrides after it (RECIPE.yaml key=value ...)")
        if args.recipe is None:
            raise ValueError("give a RECIPE.yaml, or --script SCRIPT.py")
        return load_recipe(recipe_path(args.recipe), [*args.overrides, *flags, *extra])
    path = recipe_path(args.script_recipe) if args.script_recipe is not None else None
    recipe = load_recipe(path, [*args.settings, *flags, "launch.standby=false", *extra])
    ignored = [name for name in ("model", "data") if getattr(recipe, name) is not None]
    if ignored:
        print(f"{by}: note: --script {args.script} builds its own model and data: the {' and '.join(ignored)} of "
              f"--recipe {args.script_recipe} {'are' if len(ignored) > 1 else 'is'} not used (its trainer, ft and "
              f"launch sections apply)", file=sys.stderr)
    return recipe


def script_args(args: argparse.Namespace) -> tuple[str, ...]:
    """With ``--script``: its arguments, every positional (the first is parsed as RECIPE.yaml's place)."""
    return (*([str(args.recipe)] if args.recipe is not None else []), *args.overrides)
