"""LaunchRecorder: what each replica group tells its launcher, one JSON line per event, written by the group's rank 0.

``FTHSDPStrategy`` attaches one to every fit when ``$FTHSDP_RECORD`` is set (``fthsdp launch`` sets it for every
script it starts), so an unchanged Lightning script is followed, reported on and known to have finished; a Trainer
that already has one that writes records (``fthsdp fit``'s, or a script's own) keeps it, and one that only paces
(``LaunchRecorder(None, min_step_time_s=...)``) gets one that writes. docs/launch.md, "A script's contract".

It writes ``start``, ``commit``, ``val``, ``phases`` and ``end`` records (``lightning_fthsdp.protocol.records`` has
their fields). ``min_step_time_s`` pads steps (demos and tests of tiny models).
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.config.env import ENV_RECORD, ENV_REPLICA_ID
from lightning_fthsdp.lightning.committed_step import CommittedStepCallback
from lightning_fthsdp.protocol.records import RecordKind, RecordWriter
from lightning_fthsdp.recovery.torch_state import full_params_sha256


class LaunchRecorder(CommittedStepCallback):
    """Appends the group's records to ``jsonl`` (rank 0 only); ``None`` records nothing and only paces."""

    def __init__(self, jsonl: str | None = None, min_step_time_s: float = 0.0) -> None:
        self.jsonl, self.min_step_time_s = jsonl, min_step_time_s
        self._last_t = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        anatomy.mark("setup")  # after the process group and the data module's setup, before the model is built

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        anatomy.mark("model")  # the strategy's setup ran: model sharded, optimizers and the FT manager built

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_t = time.monotonic()
        self._write(trainer, RecordKind.START, step=trainer.global_step)

    @override
    def on_committed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        if self._writes(trainer):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            record: dict[str, Any] = {"step": trainer.global_step}
            metrics = getattr(trainer.strategy, "ft_metrics", None)  # None: not FTHSDPStrategy
            trained = True
            if metrics is not None:
                manager = trainer.strategy.manager  # type: ignore[attr-defined]
                trained = manager.replica_id in manager.participants
                record |= {"quorum_size": metrics.quorum_size, "participants": list(manager.participants),
                           "discarded": metrics.discarded_steps, "catch_ups": metrics.catch_ups,
                           "checkpoint_loads": metrics.checkpoint_loads,
                           "stall_s": round(metrics.stall_s, 4)}
            if trained:
                record["loss"] = float(loss)
            written = self._write(trainer, RecordKind.COMMIT, **record)
            if trained and "trained" not in anatomy.milestones():
                anatomy.mark("trained", written["t"])
                self._write(trainer, RecordKind.PHASES, step=trainer.global_step, milestones=anatomy.milestones())
        if self.min_step_time_s:
            time.sleep(max(0.0, self.min_step_time_s - (time.monotonic() - self._last_t)))
        self._last_t = time.monotonic()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get("val_loss")
        if trainer.training is False and not trainer.sanity_checking and value is not None:
            self._write(trainer, RecordKind.VAL, step=trainer.global_step, val_loss=float(value))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.jsonl:
            return  # the same on every rank: no rank enters the collectives below
        # A collective inside the group: every rank computes it, rank 0 writes it.
        digest = full_params_sha256(pl_module)
        self._write(trainer, RecordKind.END, step=trainer.global_step, params_sha256=digest)

    def _writes(self, trainer: pl.Trainer) -> bool:
        return bool(self.jsonl) and trainer.global_rank == 0

    def _write(self, trainer: pl.Trainer, kind: str, **fields: Any) -> dict[str, Any]:
        """The record, appended on the group's rank 0 (every other rank only gets it back)."""
        # The strategy's id (an explicit argument wins over the variable), else the variable's.
        replica_id = getattr(trainer.strategy, "replica_id", None) or os.environ.get(ENV_REPLICA_ID)
        return RecordWriter(self.jsonl if self._writes(trainer) else None, replica_id).write(kind, **fields)


def attach_from_env(trainer: pl.Trainer) -> LaunchRecorder | None:
    """Add a ``LaunchRecorder`` writing to ``$FTHSDP_RECORD`` to a fit's callbacks, unless the variable is unset, the
    run is no fit, or the Trainer has a recorder that writes records already (one is enough: a second would write
    every record twice; one without a ``jsonl`` only paces, and records nothing). Call it on every rank of the group
    (the ``end`` record's digest is a collective). Returns the one added."""
    path = os.environ.get(ENV_RECORD)
    if not path or trainer.state.fn != TrainerFn.FITTING:
        return None
    if any(isinstance(c, LaunchRecorder) and c.jsonl for c in trainer.callbacks):
        return None
    recorder = LaunchRecorder(path)
    trainer.callbacks.append(recorder)
    return recorder
