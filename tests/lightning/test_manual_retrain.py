"""``manual.ManualRetrain`` on its own: a manual-optimization training_step run again inside the step being committed
gives that step its gradients, and whatever else it moves is put back; what it cannot keep consistent is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch

from lightning_fthsdp.lightning.deferred_logs import DeferredLogs
from lightning_fthsdp.lightning.manual import ManualRetrain


def trainer_of(optimizers: list[torch.optim.Optimizer], schedulers: list[Any]) -> pl.Trainer:
    """What ``ManualRetrain`` reads of a Trainer (no Lightning optimizer wrappers: nothing counts steps here)."""
    return cast(pl.Trainer, SimpleNamespace(
        optimizers=optimizers, lr_scheduler_configs=[SimpleNamespace(scheduler=s) for s in schedulers],
        strategy=SimpleNamespace(_lightning_optimizers=[])))


def test_the_step_gets_the_gradients_of_the_run_and_the_schedulers_and_learning_rates_are_put_back() -> None:
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=torch.tensor(0.5))  # schedulers update it in place
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    retrain = ManualRetrain(DeferredLogs())
    expected: list[torch.Tensor] = []  # the gradients as the run's step saw them

    def training_step() -> str:
        layer(torch.ones(2, 3)).sum().backward()
        expected.extend(p.grad.clone() for p in layer.parameters() if p.grad is not None)
        assert retrain.stepped(optimizer, lambda: "closure ran") == "closure ran"
        optimizer.zero_grad()  # after the step, as modules may
        scheduler.step()
        return "output"

    assert not retrain.active
    retrain.begin_step()
    retrain.run(trainer_of([optimizer], [scheduler]), list(layer.parameters()), optimizer, training_step)
    assert not retrain.active and retrain.end_step("the outer step's output") == "output"
    for param, grad in zip(layer.parameters(), expected, strict=True):
        assert param.grad is not None and torch.equal(param.grad, grad)
    assert optimizer.param_groups[0]["lr"].item() == 0.5 and scheduler.last_epoch == 0


@pytest.mark.parametrize(("steps", "error"), [
    ("none", "to step the optimizer in every training_step"),
    ("another", "stepped another optimizer than the step being committed"),
])
def test_a_run_that_steps_no_optimizer_or_another_is_refused_and_leaves_nothing_moved(steps: str, error: str) -> None:
    first, second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    committed = torch.optim.SGD(first.parameters(), lr=0.5)
    other = torch.optim.SGD(second.parameters(), lr=0.25)
    scheduler = torch.optim.lr_scheduler.StepLR(committed, step_size=1, gamma=0.1)
    retrain = ManualRetrain(DeferredLogs())

    def training_step() -> None:
        scheduler.step()
        if steps == "another":
            retrain.stepped(other, lambda: None)

    with pytest.raises(ValueError, match=error):
        retrain.run(trainer_of([committed, other], [scheduler]), list(first.parameters()), committed, training_step)
    assert not retrain.active
    assert committed.param_groups[0]["lr"] == 0.5 and scheduler.last_epoch == 0
