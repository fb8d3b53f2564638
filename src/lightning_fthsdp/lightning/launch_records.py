"""LaunchRecorder: what each replica group tells its launcher, one JSON line per event, written by the group's rank 0.

``FTHSDPStrategy`` attaches one to every fit when ``$FTHSDP_RECORD`` is set (``fthsdp launch`` sets it for every
script it starts), so an unchanged Lightning script is followed, reported on and known to have finished; a Trainer
that already has one that writes records (``fthsdp fit``'s, or a script's own) keeps it, and one that only paces
(``LaunchRecorder(None, min_step_time_s=...)``) gets one that writes. docs/launch.md, "A script's contract".

Records (``event``):

- ``start``: the group (re)started training (``step``: Lightning's global step, 0 unless resumed);
- ``commit``: a committed optimizer step: ``step`` (the job's committed step after it), ``loss`` (rank 0's
  micro-batch; absent from a step this group only followed while catching up: computed on weights it had not
  loaded yet, it is no training loss), ``quorum_size``, ``participants`` (ids whose gradients went into it),
  ``discarded`` (failed commit attempts of this process so far), ``catch_ups`` (catch-ups of this process),
  ``checkpoint_loads`` (durable checkpoints this process loaded), ``stall_s`` (time of this step spent in
  discarded attempts);
- ``val``: a validation during fit: ``step`` (the committed step it evaluated) and ``val_loss`` (the held-out
  loss the LightningModule logged as ``val_loss``);
- ``phases``: once, with the first step this group trained (its own gradients in it): ``milestones``, the Unix time
  at which this process reached each of ``lightning_fthsdp.config.anatomy.MILESTONES`` (the anatomy of its start);
- ``end``: training finished; ``params_sha256`` digests the full (unsharded) parameters, so groups compare their
  final states from the outside.

Every record has ``t`` (Unix time), ``replica_id`` and ``pid``. ``min_step_time_s`` pads steps (demos and tests of
tiny models).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.config.env import ENV_RECORD, ENV_REPLICA_ID
from lightning_fthsdp.lightning.committed_step import CommittedStepCallback
from lightning_fthsdp.recovery.torch_state import full_params_sha256


class LaunchRecorder(CommittedStepCallback):
    """Appends the records above to ``jsonl`` (rank 0 only); ``None`` records nothing and only paces."""

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
        self._write(trainer, {"event": "start", "step": trainer.global_step})

    @override
    def on_committed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        if self._writes(trainer):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            record: dict[str, Any] = {"event": "commit", "step": trainer.global_step}
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
            self._write(trainer, record)
            if trained and "trained" not in anatomy.milestones():
                anatomy.mark("trained", record["t"])
                self._write(trainer, {"event": "phases", "step": trainer.global_step,
                                      "milestones": anatomy.milestones()})
        if self.min_step_time_s:
            time.sleep(max(0.0, self.min_step_time_s - (time.monotonic() - self._last_t)))
        self._last_t = time.monotonic()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get("val_loss")
        if trainer.training is False and not trainer.sanity_checking and value is not None:
            self._write(trainer, {"event": "val", "step": trainer.global_step, "val_loss": float(value)})

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.jsonl:
            return  # the same on every rank: no rank enters the collectives below
        # A collective inside the group: every rank computes it, rank 0 writes it.
        digest = full_params_sha256(pl_module)
        self._write(trainer, {"event": "end", "step": trainer.global_step, "params_sha256": digest})

    def _writes(self, trainer: pl.Trainer) -> bool:
        return bool(self.jsonl) and trainer.global_rank == 0

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        if self._writes(trainer):
            # The strategy's id (an explicit argument wins over the variable), else the variable's.
            replica_id = getattr(trainer.strategy, "replica_id", None) or os.environ.get(ENV_REPLICA_ID)
            record |= {"t": time.time(), "replica_id": replica_id, "pid": os.getpid()}
            with open(self.jsonl, "a") as sink:  # type: ignore[arg-type]  # _writes: jsonl is set
                sink.write(json.dumps(record) + "\n")


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
