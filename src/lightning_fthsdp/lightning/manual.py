"""Manual optimization under FTHSDPStrategy: what it refuses, and how a module without ``configure_model`` is sharded.

A group's data position counts committed steps, and a restarted group joins at a batch boundary and must take the
same step as the others; with manual optimization the optimizer step (and with it the cross-group sync) runs inside
``training_step``. Hence exactly one optimizer step per training batch, one optimizer across replica groups, no
``keep_global_batch`` (its extra batches run ``training_step``, which would step the optimizer itself), and, without
``configure_model``, every module holding parameters its own FSDP unit (the step cannot run inside the root's
``forward``: the root's parameters must be sharded again for the optimizer step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_fthsdp.lightning import private
from lightning_fthsdp.lightning.deferred_logs import DeferredLogs
from lightning_fthsdp.lightning.policy import apply_fully_shard


def refuse_at_train_start(*, keep_global_batch: bool, optimizers: int, replicas: int) -> None:
    """Refuse the settings manual optimization cannot keep in step across groups."""
    if keep_global_batch:
        raise ValueError(
            "FTHSDPStrategy(keep_global_batch=True) trains a degraded step's extra batches through training_step, "
            "which with manual optimization would step the optimizer itself: use automatic optimization, or "
            "keep_global_batch=False (with lr_scaling for degraded steps)")
    if optimizers > 1 and replicas > 1:
        raise ValueError(
            f"FTHSDPStrategy cannot keep {optimizers} optimizers of manual optimization in step across "
            f"{replicas} replica groups: which one steps would depend on each group's own batch "
            "index, and a restarted group joins at another. Put every model in one optimizer (a param group each, "
            "e.g. torch.optim.Adam([{'params': g.parameters()}, {'params': d.parameters(), 'lr': 1e-4}])) and "
            "step it once per training_step")


class OneStepPerBatch:
    """Counts the optimizer steps of a training batch and refuses any number but one."""

    def __init__(self) -> None:
        self._steps = 0

    def start_batch(self) -> None:
        self._steps = 0

    def count_step(self) -> None:
        """An optimizer step of this batch begins (refused if it is the second)."""
        self._steps += 1
        if self._steps > 1:
            raise ValueError(
                f"FTHSDPStrategy needs one optimizer step per training batch, got {self._steps}: a group's data "
                "position counts committed steps, and a restarted group joins at a batch boundary and must take the "
                "same step as the others. Put every model in one optimizer (a param group each) and step it once "
                "per training_step")

    def check_stepped(self) -> None:
        """A manual-optimization ``training_step`` ended (refused if it stepped no optimizer)."""
        if self._steps == 0:
            raise ValueError(
                "FTHSDPStrategy needs manual optimization to step the optimizer in every training_step, got a "
                "training_step without a step: a group's data position counts committed steps. Accumulate "
                "gradients with automatic optimization (Trainer(accumulate_grad_batches=...)) instead")


class ManualRetrain:
    """A manual-optimization step trained again inside the optimizer step its ``training_step`` called: a durable
    checkpoint was loaded there (a relaunch, or a quorum resuming from one), so the gradients it had belong to the old
    weights and the old position.

    ``run(trainer, params, optimizer, train)`` calls ``train()`` (the module's ``training_step`` on the batch at the
    committed position); while it runs (``active``) the optimizer step it takes only marks its gradients
    (``stepped``), and what else that training_step moves is put back, since the outer ``training_step`` goes on to
    move it once: Lightning's count of optimizer steps, the LR schedulers (a module may step its own) and the
    optimizers' learning rates and other hyperparameters. The gradients are those of the step, even where the module
    zeroes them after stepping. What the outer ``training_step`` logged and returns came from the old weights: the
    step logs and returns the inner one's instead (``begin_step`` and ``end_step`` around the outer one)."""

    def __init__(self, logs: DeferredLogs) -> None:
        self._logs = logs
        self._params: list[torch.nn.Parameter] | None = None  # while a run is under way
        self._optimizer: Optimizer | None = None
        self._grads: list[torch.Tensor | None] | None = None
        self._step_logs = 0  # the logs recorded before the outer training_step
        self._retrained: tuple[Any, int] | None = None  # the inner one's output, and the end of its logs

    @property
    def active(self) -> bool:
        return self._params is not None

    def stepped(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        """The training_step stepped ``optimizer`` (Lightning's ``closure`` is run, its result returned as a step's
        is): its gradients are the step's."""
        assert self._params is not None
        if optimizer is not self._optimizer:
            raise ValueError("FTHSDPStrategy trained a manual-optimization step again on the batch at the loaded "
                             "position, and its training_step stepped another optimizer than the step being "
                             "committed: choose the optimizer from the trainer's global_step, not from batch_idx (a "
                             "group's batch index depends on its own data position)")
        result = closure()
        self._grads = [None if p.grad is None else p.grad.detach().clone() for p in self._params]
        return result

    def begin_step(self) -> None:
        """A training_step begins."""
        self._step_logs = self._logs.mark()

    def run(self, trainer: pl.Trainer, params: Sequence[torch.nn.Parameter], optimizer: Optimizer,
            train: Callable[[], Any]) -> None:
        self._logs.rewind(self._step_logs)  # what the outer training_step logged so far came from the old weights
        self._params, self._optimizer, self._grads = list(params), optimizer, None
        try:
            with _put_back(trainer):
                output = train()
            if self._grads is None:
                raise ValueError("FTHSDPStrategy needs manual optimization to step the optimizer in every "
                                 "training_step, got a training_step without a step when trained again after loading "
                                 "a checkpoint")
            for param, grad in zip(self._params, self._grads, strict=True):
                param.grad = grad
            self._retrained = (output, self._logs.mark())
        finally:
            self._params = self._optimizer = None

    def end_step(self, output: Any) -> Any:
        """The training_step returned ``output``: the step's output (the inner one's if it trained again, what the
        outer one logged after its step dropped)."""
        if self._retrained is None:
            return output
        (output, logged), self._retrained = self._retrained, None
        self._logs.rewind(logged)
        return output


@contextmanager
def _put_back(trainer: pl.Trainer) -> Generator[None, None, None]:
    """Inside, an optimizer step is not counted; after, the LR schedulers and the optimizers' learning rates (and
    other hyperparameters, tensors copied back in place: schedulers update a tensor learning rate in place) are what
    they were before."""
    schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
    groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
              for o in trainer.optimizers]
    try:
        with private.optimizer_step_hooks_off(trainer):
            yield
    finally:
        for config, state in zip(trainer.lr_scheduler_configs, schedulers, strict=True):
            config.scheduler.load_state_dict(state)
        for optimizer, saved in zip(trainer.optimizers, groups, strict=True):
            for group, values in zip(optimizer.param_groups, saved, strict=True):
                for key, value in values.items():
                    if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                        group[key].copy_(value)
                    else:
                        group[key] = value


def shard_for_manual_optimization(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make every module below ``module`` that holds parameters (inside) an FSDP unit of its own, then ``module``;
    refuse a module that would leave parameters to its own unit."""
    module_name = type(module).__name__  # before fully_shard renames the class
    apply_fully_shard(module, mesh, min_params=0, every_holder=True)
    in_units = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
                for p in m.parameters()}
    held = [name for name, p in module.named_parameters() if id(p) not in in_units]
    if held:
        raise ValueError(
            f"FTHSDPStrategy cannot shard {module_name} for manual optimization without configure_model: "
            f"parameters {held} would be left to the LightningModule's own unit (held by it directly, tied "
            "across modules, or beside a tied module). Move them into a submodule (tied modules under one "
            "child), or define configure_model and call fully_shard on the modules training_step uses")
