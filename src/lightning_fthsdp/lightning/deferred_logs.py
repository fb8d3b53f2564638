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

_MISSING = object()


class DeferredLogs:
    """Records the ``log`` calls made inside ``recording``; ``flush`` logs or drops them."""

    def __init__(self) -> None:
        self._calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    @contextmanager
    def recording(self, module: pl.LightningModule) -> Generator[None, None, None]:
        """While inside, ``module.log`` (and ``log_dict``, which calls it) records instead of logging."""
        own_log = module.__dict__.get("log", _MISSING)

        def record(*args: Any, **kwargs: Any) -> None:
            self._calls.append((args, kwargs))

        module.__dict__["log"] = record
        try:
            yield
        finally:
            if own_log is _MISSING:
                module.__dict__.pop("log", None)
            else:
                module.__dict__["log"] = own_log

    def flush(self, module: pl.LightningModule, *, trained: bool) -> None:
        """Log the recorded calls as ``training_step`` would have (``trained``), or drop them."""
        calls, self._calls = self._calls, []
        if not trained or not calls:
            return
        log = module.__dict__.get("log") or type(module).log.__get__(module)
        previous = module._current_fx_name  # Lightning checks where a value is logged from by this name
        module._current_fx_name = "training_step"
        try:
            for args, kwargs in calls:
                log(*args, **kwargs)
        finally:
            module._current_fx_name = previous
