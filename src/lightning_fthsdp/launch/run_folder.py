"""The run's folder (``--out``) of ``fthsdp launch`` and ``fthsdp slurm``: what a start may replace in it, where a
relative checkpoint folder goes, and where a relaunch resumes.

A start deletes nothing. The folder it prepares carries ``MARKER`` (written by each start); a start moves the
previous run's records there (the ``OWNED`` folders and ``REPORTS``; a copy of its ``recipe.yaml``) into
``KEPT/TIME/`` (TIME: when that run started), so a rerun with the same ``--out`` neither mixes its records with the
previous run's nor silently loses them; and it refuses a folder that holds anything without the marker (``--out .`` in
a project must not touch its ``logs/``). A relative ``ft.checkpoint_dir`` goes under the run's folder and must stay
there, beside the owned folders; an absolute one is the user's. A checkpoint folder is never moved by a start: a
relaunch with the same recipe resumes from its newest complete checkpoint (as torchtitan does), and ``--fresh``
moves its checkpoints aside (``previous-TIME/``, which no reader looks into) instead of deleting them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.recipes.schema import RecipeConfig
    from lightning_fthsdp.recovery.checkpoint import CheckpointInfo

MARKER = ".fthsdp-run"
"""The file that says a launcher prepared this folder (JSON: which command, when)."""

OWNED = ("groups", "logs", "lightning", "standby")
"""The folders a start empties (their content moves to ``KEPT``): the previous run's records would mix with this
run's."""

REPORTS = ("report.json", "report.png")
"""The files a run writes at its end, moved to ``KEPT`` by the next start (a new run without one has not ended)."""

KEPT = "previous-runs"
"""Where a start keeps the previous run's records: ``KEPT/TIME/`` (delete them when no longer needed)."""


def checkpoint_folder(recipe: RecipeConfig, out: Path) -> None:
    """Put a relative ``ft.checkpoint_dir`` under the run's folder ``out`` (absolute: every group, wherever its
    working directory, is handed the same path). Raises ValueError for one that leaves the run's folder, is the run's
    folder itself, or lies in a folder a start replaces."""
    given = recipe.ft.checkpoint_dir
    if not given or Path(given).is_absolute():
        return
    folder = Path(os.path.normpath(out / given))  # lexically: ".." must not climb out of the run
    inside = folder.relative_to(out).parts if folder.is_relative_to(out) else None
    if not inside or inside[0] in (*OWNED, KEPT):
        where = "the run's folder itself" if inside == () else (
            f"in its {inside[0]}/, which every start empties or fills" if inside else "outside the run's folder")
        raise ValueError(f"ft.checkpoint_dir={given} is {folder}, {where} (--out {out}): a relative checkpoint folder "
                         f"goes under the run's folder, beside {', '.join(OWNED)} (e.g. ft.checkpoint_dir=checkpoints);"
                         f" give an absolute path to keep checkpoints elsewhere")
    recipe.ft.checkpoint_dir = str(folder)


def resume_point(recipe: RecipeConfig, fresh: bool) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``ft.checkpoint_dir`` the job resumes from (None: it starts at step 0).
    ``fresh``: move every checkpoint there aside (never deleted) and start at step 0. Raises ValueError naming
    ``--fresh`` when the newest one cannot be resumed (another shard count, at or beyond ``trainer.max_steps``)."""
    if not recipe.ft.checkpoint_dir:
        return None
    from lightning_fthsdp.recovery.checkpoint import newest_checkpoint, step_folders

    root = Path(recipe.ft.checkpoint_dir)
    if fresh:
        old = step_folders(root)
        if old:
            aside = root / time.strftime("previous-%Y%m%d-%H%M%S")
            aside.mkdir()
            for folder in old:
                folder.rename(aside / folder.name)
            print(f"starting afresh (--fresh): the {len(old)} checkpoint folders in {root} moved to {aside}",
                  flush=True)
        return None
    newest = newest_checkpoint(root)
    if newest is None:
        return None
    if newest.shard_count != recipe.launch.shard_count:
        raise ValueError(f"ft.checkpoint_dir {root} holds the checkpoint of step {newest.step}, written by "
                         f"{newest.shard_count} shard ranks, but launch.shard_count={recipe.launch.shard_count}: "
                         f"resume it with launch.shard_count={newest.shard_count}, or pass --fresh to start at step 0 "
                         f"(the checkpoints are moved aside, not deleted)")
    if newest.step >= recipe.trainer.max_steps:
        raise ValueError(f"ft.checkpoint_dir {root} holds the checkpoint of step {newest.step}, at or beyond "
                         f"trainer.max_steps={recipe.trainer.max_steps}: this job is complete. Raise trainer.max_steps "
                         f"to train on from it, or pass --fresh to start at step 0 (the checkpoints are moved aside, "
                         f"not deleted)")
    return newest


def usable(given: Path, by: str) -> Path:
    """The run's folder ``--out``, absolute, once it is known a start may use it (nothing is changed yet). Raises
    SystemExit for a file, or a folder holding anything a launcher did not prepare."""
    out = given.resolve()
    if out.exists() and not out.is_dir():
        raise SystemExit(f"{by}: error: --out {given} is a file: name a folder (it is created if missing)")
    if out.is_dir() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise SystemExit(f"{by}: error: --out {given} holds files no launcher wrote (it has no {MARKER} marker), and a "
                         f"start moves what its {', '.join(OWNED)} folders hold: choose a new or empty folder")
    return out


def prepare(out: Path, by: str) -> Path:
    """The run's folder ``out`` (``usable``), marked as ``by``'s, its previous run's records moved to ``KEPT``
    (printed: where they went)."""
    out.mkdir(parents=True, exist_ok=True)
    kept = keep_previous(out)
    if kept is not None:
        print(f"{by}: the previous run's records in {out} moved to {kept}", flush=True)
    mark(out, by)
    (out / "logs").mkdir()
    return out


def mark(out: Path, by: str) -> None:
    """Write ``MARKER`` in ``out``: ``by`` (a command) prepared it, now."""
    (out / MARKER).write_text(json.dumps({"by": by, "t": time.time()}) + "\n")


def keep_previous(out: Path, also: Sequence[Path] = ()) -> Path | None:
    """Move the records of the run that last prepared ``out`` (its ``OWNED`` folders' content, ``REPORTS``; a copy
    of ``recipe.yaml``, which the caller rewrites or reads; ``also``: other records of its, in ``out``) to
    ``KEPT/TIME/``; that folder, None when there were no records (a fresh folder, or one a start prepared whose run
    wrote nothing yet)."""
    owned = [out / name for name in OWNED if (out / name).is_symlink() or _holds_anything(out / name)]
    reports = [out / name for name in REPORTS if (out / name).is_file()]
    for name in OWNED:  # an empty one holds no record
        if (out / name).is_dir() and not (out / name).is_symlink() and out / name not in owned:
            (out / name).rmdir()
    if not owned and not reports and not also:
        return None
    aside = _kept_folder(out)
    aside.mkdir(parents=True)
    if (out / "recipe.yaml").is_file():
        shutil.copy2(out / "recipe.yaml", aside / "recipe.yaml")
    for path in [*owned, *reports, *also]:
        path.rename(aside / path.name)  # a link moves as a link: what it points at is never touched
    return aside


def _holds_anything(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _kept_folder(out: Path) -> Path:
    """``KEPT/TIME``, TIME when the previous run started (its marker's), else now; ``-2``, ``-3``... if taken."""
    try:
        started = float(json.loads((out / MARKER).read_text())["t"])
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable marker still marks the launcher's folder
        started = time.time()
    base = out / KEPT / time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
