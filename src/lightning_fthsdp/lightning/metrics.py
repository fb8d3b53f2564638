"""Fault-tolerance metrics through Lightning's loggers and progress bar.

Logged after every training step that stepped the optimizer (``on_step``, not reduced across ranks: every rank of
a group holds the same values):

- ``fthsdp/quorum_size``: groups in the quorum of the last step (progress bar);
- ``fthsdp/participants``: groups whose gradients went into it (progress bar; below ``quorum_size`` while a group
  catches up, below ``replicas`` while degraded);
- ``fthsdp/discarded_steps``: attempts whose commit vote failed so far (each was retried on the same batch);
- ``fthsdp/catch_ups``: catch-ups this group performed (loads of a peer's state);
- ``fthsdp/checkpoint_loads``: durable checkpoints this group loaded (a quorum no live group held the job's state for);
- ``fthsdp/stall_s``: seconds the last step spent in attempts that were discarded (0 when fault-free).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_fthsdp.lightning.committed_step import CommittedStepCallback
from lightning_fthsdp.manager import FTManager

_PROGRESS_BAR = ("quorum_size", "participants")


@dataclass
class FTMetrics:
    """The values of the last committed step."""

    quorum_size: int = 0
    participants: int = 0
    discarded_steps: int = 0
    catch_ups: int = 0
    checkpoint_loads: int = 0
    stall_s: float = 0.0

    def record_commit(self, manager: FTManager, *, caught_up: bool, stall_s: float) -> None:
        """Take the values of the step ``manager`` just committed (``caught_up``: that commit loaded a peer's state;
        ``stall_s``: the time the step spent in discarded attempts)."""
        if caught_up:
            self.catch_ups += 1
        self.quorum_size = len(manager.quorum.members) if manager.quorum is not None else 0
        self.participants = len(manager.participants)
        self.discarded_steps = manager.discarded_steps
        self.checkpoint_loads = manager.checkpoint_loads
        self.stall_s = stall_s


class FTMetricsLogger(CommittedStepCallback):
    """Logs ``FTHSDPStrategy.ft_metrics``; the strategy adds one to the trainer, you never need to."""

    def __init__(self, metrics: FTMetrics) -> None:
        self._metrics = metrics

    @override
    def on_committed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        for name, value in asdict(self._metrics).items():
            pl_module.log(f"fthsdp/{name}", float(value), on_step=True, on_epoch=False,
                          prog_bar=name in _PROGRESS_BAR, batch_size=1)
