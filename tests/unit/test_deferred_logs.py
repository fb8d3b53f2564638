"""DeferredLogs: a training step's self.log calls are recorded, then logged (trained) or dropped (followed)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_fthsdp.lightning.deferred_logs import DeferredLogs


class Module(pl.LightningModule):
    """Records what reaches LightningModule.log, and from which hook Lightning would see it logged."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[str, Any, str | None]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.logged.append((name, value, self._current_fx_name))


def test_recorded_calls_reach_log_only_when_trained() -> None:
    module, logs = Module(), DeferredLogs()
    module._current_fx_name = "training_step"
    with logs.recording(module):
        module.log("loss", 1.0)
        module.log_dict({"a": 2.0, "b": 3.0})
    assert module.logged == [] and "log" not in module.__dict__
    module._current_fx_name = "optimizer_step"
    logs.flush(module, trained=True)
    assert module.logged == [("loss", 1.0, "training_step"), ("a", 2.0, "training_step"),
                             ("b", 3.0, "training_step")]
    assert module._current_fx_name == "optimizer_step"

    with logs.recording(module):
        module.log("loss", 4.0)
    logs.flush(module, trained=False)
    logs.flush(module, trained=True)
    assert len(module.logged) == 3, "a followed step's calls are dropped, not kept for the next step"


def test_rewind_forgets_a_discarded_attempts_calls() -> None:
    module, logs = Module(), DeferredLogs()
    with logs.recording(module):
        module.log("loss", 1.0)
        mark = logs.mark()
        module.log("extra", 2.0)
    logs.rewind(mark)
    with logs.recording(module):
        module.log("extra", 3.0)
    logs.flush(module, trained=True)
    assert [(name, value) for name, value, _ in module.logged] == [("loss", 1.0), ("extra", 3.0)]
