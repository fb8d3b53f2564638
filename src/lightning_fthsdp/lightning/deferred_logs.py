"""The ``self.log`` calls of a training step, held until the step commits.

A replica group that restarts computes its first step on weights it has not loaded yet (it follows the job while
the healthy groups' state arrives, contributing nothing): the loss of that step is not training, and must reach
neither the loggers nor the progress bar nor an epoch mean. Whether a step was trained is known only at its commit,
after ``training_step`` has run, so its log calls are recorded and then logged (the group trained it) or dropped
(it followed it). Logging happens in the same order and on every rank of the group, so ``sync_dist=True`` still
meets the same collectives.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl

from lightning_fthsdp.lightning import private
from lightning_fthsdp.lightning.instance_attribute import set_for_now


class DeferredLogs:
    """Records the ``log`` calls made inside ``recording``; ``flush`` logs or drops them."""

    def __init__(self) -> None:
        self._calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    @contextmanager
    def recording(self, module: pl.LightningModule) -> Generator[None, None, None]:
        """While inside, ``module.log`` (and ``log_dict``, which calls it) records instead of logging."""
        restore = set_for_now(module, "log", lambda *args, **kwargs: self._calls.append((args, kwargs)))
        try:
            yield
        finally:
            restore()

    def mark(self) -> int:
        """A point to ``rewind`` to."""
        return len(self._calls)

    def rewind(self, mark: int) -> None:
        """Forget the calls recorded since ``mark`` (a discarded attempt's extra batches, trained again)."""
        del self._calls[mark:]

    def flush(self, module: pl.LightningModule, *, trained: bool) -> None:
        """Log the recorded calls as ``training_step`` would have (``trained``), or drop them."""
        calls, self._calls = self._calls, []
        if not trained or not calls:
            return
        with private.logging_from(module, "training_step"):  # Lightning checks where a value is logged from
            for args, kwargs in calls:
                module.log(*args, **kwargs)
