"""JobSchedulers: LR schedulers stepped by job-wide counts, and their state as catch-up state.

Lightning steps a scheduler by this group's own batch index and epoch, which differ between groups once one has
restarted (or trained extra batches with ``keep_global_batch``). Under automatic optimization the strategy takes
the schedulers over and steps them by counts that are the same in every group: interval "step" every ``frequency``
committed steps, "epoch" every ``frequency`` job epochs (a job epoch is the committed steps in which one group's
shard of the data is trained once). ``ReduceLROnPlateau`` (stepped on a monitored metric) stays with Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import LRSchedulerConfig

from lightning_fthsdp.lightning import private


class JobSchedulers:
    """The LR schedulers the strategy steps (none until ``take_over``)."""

    def __init__(self) -> None:
        self._configs: list[LRSchedulerConfig] = []

    def take_over(self, trainer: pl.Trainer) -> None:
        """Stop Lightning from stepping the schedulers other than ``ReduceLROnPlateau``; ``step`` steps them."""
        def plateau_only(interval: str, update_plateau_schedulers: bool) -> None:
            # Lightning's own update handles plateau schedulers only when asked for them, the others only when not.
            if update_plateau_schedulers:
                lightning_update(interval=interval, update_plateau_schedulers=True)

        lightning_update = private.replace_scheduler_update(trainer, plateau_only)
        self._configs = [config for config in trainer.lr_scheduler_configs if not config.reduce_on_plateau]

    def step(self, trainer: pl.Trainer, committed_steps: int, steps_per_epoch: Callable[[], int]) -> None:
        """Step the schedulers due after ``committed_steps`` job-wide steps (``steps_per_epoch``: of a job epoch)."""
        for config in self._configs:
            if config.interval == "step":
                due = committed_steps % config.frequency == 0
            else:
                per_epoch = steps_per_epoch()
                due = committed_steps % per_epoch == 0 and (committed_steps // per_epoch) % config.frequency == 0
            if due:
                _step_as_lightning(trainer, config)


def _step_as_lightning(trainer: pl.Trainer, config: LRSchedulerConfig) -> None:
    """Step one scheduler as Lightning would (through the LightningModule's ``lr_scheduler_step`` hook)."""
    progress = private.scheduler_progress(trainer)
    progress.increment_ready()
    private.call_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
    progress.increment_completed()
