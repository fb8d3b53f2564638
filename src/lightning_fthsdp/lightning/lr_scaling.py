"""DegradedLR: the learning rate of an optimizer step that fewer than all replica groups contributed to.

While ``h`` of ``N`` groups contribute, the global batch shrinks to ``h/N`` of a healthy step's; the optimizer step
then uses ``lr x 1 | h/N | sqrt(h/N)`` ("none", "linear", "sqrt"; the FT-HSDP paper found sqrt best). The factor
applies to that one step: the scheduler's own values are never changed.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextlib import contextmanager
from typing import Literal

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

LRScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS = ("none", "linear", "sqrt")


def check_lr_scaling(lr_scaling: str, keep_global_batch: bool) -> None:
    """Refuse an unknown scaling, and scaling together with ``keep_global_batch`` (whose batch does not shrink)."""
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"FTHSDPStrategy lr_scaling must be one of {LR_SCALINGS}, got {lr_scaling!r}")
    if keep_global_batch and lr_scaling != "none":
        raise ValueError(f"FTHSDPStrategy got keep_global_batch=True with lr_scaling={lr_scaling!r}: the learning "
                         "rate scaling is for a global batch that shrinks while degraded; keep_global_batch keeps "
                         "it constant. Choose one (lr_scaling='none' with keep_global_batch=True)")


class DegradedLR:
    """Scales the learning rates of one optimizer step by the share of groups that contributed to it."""

    def __init__(self, lr_scaling: LRScaling, replicas: int) -> None:
        self.lr_scaling = lr_scaling
        self.replicas = replicas
        self._unscaled_lrs: list[float] | None = None  # the step's learning rates before the factor

    @contextmanager
    def one_step(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """Around one optimizer step: the learning rates ``scale`` sets inside are put back when it ends."""
        param_groups = _inner(optimizer).param_groups
        saved_lrs = [group["lr"] for group in param_groups]
        self._unscaled_lrs = None
        try:
            yield
        finally:
            # A catch-up inside the step may have loaded other rates: ``scale`` saw those, and they are kept.
            for group, lr in zip(_inner(optimizer).param_groups, self._unscaled_lrs or saved_lrs, strict=True):
                group["lr"] = lr

    def scale(self, optimizer: Optimizer, healthy: int) -> None:
        """Multiply the learning rates by this step's factor (``healthy`` groups contributed)."""
        param_groups = _inner(optimizer).param_groups
        self._unscaled_lrs = [group["lr"] for group in param_groups]
        ratio = min(healthy / self.replicas, 1.0)
        factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]
        for group in param_groups:
            group["lr"] = group["lr"] * factor


def _inner(optimizer: Optimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
