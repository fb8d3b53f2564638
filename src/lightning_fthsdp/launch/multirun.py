"""``fthsdp launch -m``: a sweep, as Hydra's multirun runs one. The overrides' comma-separated values
(``model=mlp,tiny_gpt trainer.max_steps=50,100``) make one job per combination (the last override varying fastest),
run one after another, each a whole ``fthsdp launch`` in its own run folder ``OUT/0``, ``OUT/1``, ...;
``OUT/multirun.yaml`` lists each job's overrides, folder and exit code as they end.

Before the first job starts, every job goes through every check of a launch (``launch.job_checks``: its recipe, and
what its start in ``OUT/N`` needs: a chaos step it reaches, its checkpoint folder and what it resumes from), and
``OUT`` through the run folder's rules (``launch.run_folder``): a job the launch would refuse is refused before any
trains, each named. ``OUT`` is a sweep's own folder: the previous sweep's ``multirun.yaml``, and the folders
``OUT/N`` of jobs this sweep does not have (a bigger earlier sweep), move to ``OUT/previous-runs/TIME/``; a job's own
folder keeps its previous run as every start does. A job refused at its start all the same (something changed since
the check) is recorded with its error and the sweep goes on to the next. Hydra's own command-line flags (``--cfg``,
``--config-name``, ...) are refused as not supported: fthsdp runs no Hydra app.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_fthsdp.recipes.schema import RecipeConfig

BY = "fthsdp launch"
SWEEP = "fthsdp launch -m"
INDEX = "multirun.yaml"
"""The sweep's index in ``OUT``: each job's overrides, folder and exit code (and error, if refused at its start)."""

#: Hydra's application flags: fthsdp's commands name the recipe, print it and choose the run folder their own way.
_HYDRA_FLAGS = {("--cfg", "-c"): "--print-config prints the composed recipe",
                ("--resolve",): "--print-config prints it resolved",
                ("--package", "-p"): "--print-config prints the whole recipe",
                ("--info", "-i"): "--print-config shows what the recipe composes to",
                ("--config-path", "-cp"): "give the recipe's path (its configs/ folders are searched, docs/recipes.md)",
                ("--config-name", "-cn"): "give the recipe's path",
                ("--config-dir", "-cd"): "put the options in configs/ beside the recipe (docs/recipes.md)",
                ("--hydra-help",): "see docs/recipes.md",
                ("--run", "-r"): "a run is the default; -m runs a sweep"}


class _NotSupported(argparse.Action):
    def __init__(self, *args: Any, fix: str, **kwargs: Any) -> None:
        super().__init__(*args, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.fix = fix

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is Hydra's and not supported: {self.fix}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``-m/--multirun``, and Hydra's application flags, each refused naming what to do instead; no abbreviations:
    ``-c`` (Hydra's ``--cfg``) must not read as a prefix of ``-cp``, ``-cn``, ``-cd``, nor ``--con`` as one of
    theirs."""
    parser.allow_abbrev = False
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="sweep: one job per combination of the overrides' comma-separated values "
                             "(model=mlp,tiny_gpt), one after another, in OUT/0, OUT/1, ... (OUT/multirun.yaml "
                             "lists them)")
    for flags, fix in _HYDRA_FLAGS.items():
        parser.add_argument(*flags, action=_NotSupported, fix=fix, dest=f"hydra_{flags[0].lstrip('-')}")


def sweep(args: argparse.Namespace, launch: Callable[[argparse.Namespace], int]) -> int:
    """Run ``launch`` (``fthsdp launch`` of one recipe) once per job of the sweep in ``args``; 0 when every job's
    exit code is 0. ``--print-config`` prints each job's recipe instead."""
    from lightning_fthsdp.launch.run_folder import usable
    from lightning_fthsdp.recipes.loader import to_yaml
    from lightning_fthsdp.recipes.overrides import OverrideError, expand

    if args.script is not None:
        raise SystemExit(f"{BY}: error: -m sweeps a recipe's overrides; a --script's arguments are the script's own: "
                         "run one launch per setting")
    try:
        jobs = [_job(args, index, overrides) for index, overrides in enumerate(expand(args.overrides))]
    except OverrideError as err:
        raise SystemExit(f"{BY}: error: {err}") from None
    if args.print_config:  # a plan, as a launch's: each job's recipe, startable here or not
        printed = [f"# job {index}: {' '.join(job.overrides) or '(no overrides)'}\n"
                   f"{to_yaml(_check(job, index, start=False))}" for index, job in enumerate(jobs)]
        print("---\n".join(printed), end="")
        return 0
    root = usable(args.out, SWEEP)
    for index, job in enumerate(jobs):  # every check of a launch, before any job starts
        _check(job, index, start=True)
    _prepare_root(root, len(jobs))
    print(f"{SWEEP}: {len(jobs)} jobs in {args.out}/0..{len(jobs) - 1}", flush=True)
    done: list[dict[str, Any]] = []
    for index, job in enumerate(jobs):
        print(f"\n[job {index}/{len(jobs)}] {' '.join(job.overrides)} -> {job.out}", flush=True)
        entry: dict[str, Any] = {"job": index, "overrides": job.overrides, "out": str(job.out)}
        try:
            entry["exit_code"] = launch(job)
        except SystemExit as refused:  # a refusal at its start: recorded, and the next job runs
            if isinstance(refused.code, str):  # a message: Python's exit code for it is 1
                entry.update(exit_code=1, error=refused.code)
                print(refused.code, file=sys.stderr, flush=True)
            else:
                entry["exit_code"] = refused.code or 0
        done.append(entry)
        _write_index(root, done, len(jobs))
        if _terminated(job.out):  # a scheduler's limit or cancel ends the sweep, not only its current job
            print(f"{SWEEP}: job {index} was terminated: the sweep stops", flush=True)
            break
    failed = [d["job"] for d in done if d["exit_code"] != 0]
    print(f"\n{SWEEP}: {len(done)} of {len(jobs)} jobs ran; failed: {failed or 'none'} "
          f"({root / INDEX})", flush=True)
    return 0 if not failed and len(done) == len(jobs) else 1


def _check(job: argparse.Namespace, index: int, start: bool) -> RecipeConfig:
    """Every check of the job's launch (``start``: its start in its run folder too, with nothing moved), and its
    recipe; a refusal names the job."""
    from lightning_fthsdp.launch import job_checks

    try:
        recipe, _, faults = job_checks.composed(job, BY)
        if start:
            job_checks.startable(job, recipe, faults, BY, dry_run=True)
    except SystemExit as refused:
        raise SystemExit(f"{SWEEP}: error: job {index} ({' '.join(job.overrides) or 'no overrides'}) would be "
                         f"refused, so no job started: {refused.code}") from None
    return recipe


def _job(args: argparse.Namespace, index: int, overrides: list[str]) -> argparse.Namespace:
    job = copy.copy(args)
    job.overrides, job.out, job.multirun = overrides, args.out / str(index), False
    return job


def _prepare_root(root: Path, jobs: int) -> None:
    """Mark ``root`` as the sweep's, its previous sweep's ``multirun.yaml`` and the folders of jobs beyond ``jobs``
    moved to ``KEPT`` (a job's own folder keeps its previous run itself, as every start does)."""
    from lightning_fthsdp.launch.run_folder import keep_previous, mark

    root.mkdir(parents=True, exist_ok=True)
    stale = [p for p in root.iterdir() if p.name == INDEX or (p.is_dir() and p.name.isdigit() and int(p.name) >= jobs)]
    kept = keep_previous(root, also=sorted(stale))
    if kept is not None:
        print(f"{SWEEP}: the previous sweep's {', '.join(sorted(p.name for p in stale))} in {root} moved to {kept}",
              flush=True)
    mark(root, SWEEP)


def _write_index(out: Path, done: list[dict[str, Any]], total: int) -> None:
    from omegaconf import OmegaConf

    (out / INDEX).write_text(OmegaConf.to_yaml({"jobs_planned": total, "jobs": done}))


def _terminated(out: Path) -> bool:
    try:
        return str(json.loads((out / "report.json").read_text()).get("outcome", "")).startswith("terminated")
    except (OSError, ValueError):
        return False
