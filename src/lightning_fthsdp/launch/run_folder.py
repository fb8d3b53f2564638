"""The run's folder (``--out``) of ``fthsdp launch`` and ``fthsdp slurm``: what a start may replace in it, where a
relative checkpoint folder goes, and where a relaunch resumes.

A start deletes or overwrites only what a launcher made. The folder it prepares carries ``MARKER`` (written when a
launcher first prepares it); a start replaces the launcher's records there (the ``OWNED`` folders and the files it
writes: ``recipe.yaml``, ``report.json``, ...), and refuses a folder that holds anything without the marker (``--out
.`` in a project must not clear its ``logs/``). A relative ``ft.checkpoint_dir`` goes under the run's folder and must
stay there, beside the owned folders; an absolute one is the user's. A checkpoint folder is never deleted by a start:
a relaunch with the same recipe resumes from its newest complete checkpoint (as torchtitan does), and ``--fresh``
moves its checkpoints aside (``previous-TIME/``, which no reader looks into) instead of deleting them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_fthsdp.recipes.schema import RecipeConfig
    from lightning_fthsdp.recovery.checkpoint import CheckpointInfo

MARKER = ".fthsdp-run"
"""The file that says a launcher prepared this folder (JSON: which command, when)."""

OWNED = ("groups", "logs", "lightning", "standby")
"""The folders a start replaces: the previous run's records would mix with this run's."""


def checkpoint_folder(recipe: RecipeConfig, out: Path) -> None:
    """Put a relative ``ft.checkpoint_dir`` under the run's folder ``out`` (absolute: every group, wherever its
    working directory, is handed the same path). Raises ValueError for one that leaves the run's folder, is the run's
    folder itself, or lies in a folder a start replaces."""
    given = recipe.ft.checkpoint_dir
    if not given or Path(given).is_absolute():
        return
    folder = Path(os.path.normpath(out / given))  # lexically: ".." must not climb out of the run
    inside = folder.relative_to(out).parts if folder.is_relative_to(out) else None
    if not inside or inside[0] in OWNED:
        where = "the run's folder itself" if inside == () else (
            f"in its {inside[0]}/, which every start replaces" if inside else "outside the run's folder")
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
                         f"start replaces its {', '.join(OWNED)} folders: choose a new or empty folder")
    return out


def prepare(out: Path, by: str) -> Path:
    """The run's folder ``out`` (``usable``), marked as ``by``'s, without a previous run's records."""
    marker = out / MARKER
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"by": by, "t": time.time()}) + "\n")
    for name in OWNED:
        owned = out / name
        if owned.is_symlink():  # the link only, never what it points at
            owned.unlink()
        elif owned.is_dir():
            shutil.rmtree(owned)
    (out / "logs").mkdir()
    return out
