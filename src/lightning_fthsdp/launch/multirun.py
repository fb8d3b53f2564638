"""``fthsdp launch -m``: a sweep, as Hydra's multirun runs one. The overrides' comma-separated values
(``model=mlp,tiny_gpt trainer.max_steps=50,100``) make one job per combination (the last override varying fastest),
run one after another, each a whole ``fthsdp launch`` in its own run folder ``OUT/0``, ``OUT/1``, ...;
``OUT/multirun.yaml`` lists each job's overrides, folder and exit code as they end. Every job's recipe is composed
and checked before the first starts, so a bad combination fails at once, not after the jobs before it. Hydra's own
command-line flags (``--cfg``, ``--config-name``, ...) are refused as not supported: fthsdp runs no Hydra app.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Hydra's application flags: fthsdp's commands name the recipe, print it and choose the run folder their own way.
_HYDRA_FLAGS = {("--cfg",): "--print-config prints the composed recipe",
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
    """``-m/--multirun``, and Hydra's application flags, each refused naming what to do instead."""
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="sweep: one job per combination of the overrides' comma-separated values "
                             "(model=mlp,tiny_gpt), one after another, in OUT/0, OUT/1, ... (OUT/multirun.yaml "
                             "lists them)")
    for flags, fix in _HYDRA_FLAGS.items():
        parser.add_argument(*flags, action=_NotSupported, fix=fix, dest=f"hydra_{flags[0].lstrip('-')}")


def sweep(args: argparse.Namespace, launch: Callable[[argparse.Namespace], int]) -> int:
    """Run ``launch`` (``fthsdp launch`` of one recipe) once per job of the sweep in ``args``; 0 when every job's
    exit code is 0. ``--print-config`` prints each job's recipe instead."""
    from lightning_fthsdp.recipes.overrides import OverrideError, expand

    if args.script is not None:
        raise SystemExit("fthsdp launch: error: -m sweeps a recipe's overrides; a --script's arguments are the "
                         "script's own: run one launch per setting")
    try:
        jobs = expand(args.overrides)
    except OverrideError as err:
        raise SystemExit(f"fthsdp launch: error: {err}") from None
    printed = []
    for index, overrides in enumerate(jobs):  # every check of a launch, before any job starts
        with contextlib.redirect_stdout(io.StringIO()) as text:
            launch(_job(args, index, overrides, print_config=True))
        printed.append(f"# job {index}: {' '.join(overrides) or '(no overrides)'}\n{text.getvalue()}")
    if args.print_config:
        print("---\n".join(printed), end="")
        return 0
    print(f"fthsdp launch -m: {len(jobs)} jobs in {args.out}/0..{len(jobs) - 1}", flush=True)
    done: list[dict[str, Any]] = []
    for index, overrides in enumerate(jobs):
        job = _job(args, index, overrides, print_config=False)
        print(f"\n[job {index}/{len(jobs)}] {' '.join(overrides)} -> {job.out}", flush=True)
        code = launch(job)
        done.append({"job": index, "overrides": overrides, "out": str(job.out), "exit_code": code})
        _write_index(args.out, done, len(jobs))
        if _terminated(job.out):  # a scheduler's limit or cancel ends the sweep, not only its current job
            print(f"fthsdp launch -m: job {index} was terminated: the sweep stops", flush=True)
            break
    failed = [d["job"] for d in done if d["exit_code"] != 0]
    print(f"\nfthsdp launch -m: {len(done)} of {len(jobs)} jobs ran; failed: {failed or 'none'} "
          f"({args.out / 'multirun.yaml'})", flush=True)
    return 0 if not failed and len(done) == len(jobs) else 1


def _job(args: argparse.Namespace, index: int, overrides: list[str], print_config: bool) -> argparse.Namespace:
    job = copy.copy(args)
    job.overrides, job.out, job.multirun, job.print_config = overrides, args.out / str(index), False, print_config
    return job


def _write_index(out: Path, done: list[dict[str, Any]], total: int) -> None:
    from omegaconf import OmegaConf

    out.mkdir(parents=True, exist_ok=True)
    (out / "multirun.yaml").write_text(OmegaConf.to_yaml({"jobs_planned": total, "jobs": done}))


def _terminated(out: Path) -> bool:
    try:
        return str(json.loads((out / "report.json").read_text()).get("outcome", "")).startswith("terminated")
    except (OSError, ValueError):
        return False
