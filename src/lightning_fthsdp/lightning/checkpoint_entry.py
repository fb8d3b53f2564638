"""What of the fault-tolerant state a Lightning checkpoint (``Trainer.save_checkpoint``, ``ModelCheckpoint``) carries,
so that every group may resume from the one checkpoint the writing group wrote: the job's step and each group's data
position, under the ``fthsdp`` key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_fthsdp.manager import FTManager

KEY = "fthsdp"


def write_entry(checkpoint: dict[str, Any], manager: FTManager) -> None:
    checkpoint[KEY] = {"writer": manager.replica_id, "step": manager.step,
                       "batches_committed": dict(manager.batches_committed)}


def read_entry(checkpoint: dict[str, Any], path: str | Path, manager: FTManager) -> None:
    """Set ``manager``'s step and data positions from ``checkpoint`` (read from ``path``); ValueError for a checkpoint
    another strategy wrote."""
    state = checkpoint.get(KEY)
    if state is None:
        raise ValueError(f"FTHSDPStrategy cannot resume from {path}: it was not written by FTHSDPStrategy (no "
                         f"{KEY!r} entry); start from weights instead")
    manager.step = int(state["step"])
    manager.batches_committed = {str(k): int(v) for k, v in state["batches_committed"].items()}
