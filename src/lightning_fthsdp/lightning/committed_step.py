"""CommittedStepCallback: a Lightning callback hook that runs once per committed optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class CommittedStepCallback(Callback):
    """Calls ``on_committed_step`` once per optimizer step: Lightning's ``on_train_batch_end`` runs for every
    micro-batch, and with gradient accumulation most of them commit nothing (``global_step`` does not move)."""

    _last_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed fit: the step it resumes at was committed before

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: nothing was committed
        self._last_step = trainer.global_step
        self.on_committed_step(trainer, pl_module, outputs, batch, batch_idx)

    def on_committed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        """Runs after each committed optimizer step (``trainer.global_step`` is its number)."""
