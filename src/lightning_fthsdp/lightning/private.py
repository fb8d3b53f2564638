"""Every private or undocumented member of Lightning and torch that the Lightning front end relies on.

Any of them may be renamed, removed or given another meaning in a minor release. This module is the only one of
``lightning_fthsdp.lightning`` that reaches them (the others call the small accessors below), and
``tests/lightning/test_private_members.py`` checks each one against the installed Lightning and torch, so an upgrade
that breaks one fails there, by name, instead of in a training run.

Lightning, strategy and data:

- ``ModelParallelStrategy._data_parallel_size`` / ``_tensor_parallel_size``: the mesh shape its ``setup_environment``
  builds; a replica group shards over all of its devices, a count known only once the devices are (the constructor
  arguments take the sizes before that).
- ``lightning.pytorch.utilities.data._update_dataloader(dataloader, sampler)``: re-creates a user's DataLoader
  (subclasses and their arguments included) with our sampler, as Lightning does when it injects its own.
- ``Strategy._lightning_optimizers``: the ``LightningOptimizer`` wrappers Lightning hands to the LightningModule's
  ``optimizer_step`` hook; a replayed step hands it the same.
- ``LightningOptimizer._on_before_step`` / ``_on_after_step`` and ``lightning.pytorch.core.optimizer.
  do_nothing_closure``: the manual loop's count of optimizer steps (and profiler range) around each step, muted while a
  manual-optimization ``training_step`` trains again inside the step it called (``manual.ManualRetrain``).

Lightning, hooks:

- ``lightning.pytorch.trainer.call._call_lightning_module_hook(trainer, hook_name, *args)``: calls a hook as Lightning
  does (its profiler range, ``_current_fx_name``), for the scheduler steps the strategy takes over.
- ``LightningModule._current_fx_name``: the hook ``self.log`` checks a value is logged from; logs held until a
  commit are logged as ``training_step``'s.

Lightning, the training loops (``trainer.fit_loop`` is a ``_FitLoop``, its ``epoch_loop`` a ``_TrainingEpochLoop``;
their progress trackers are undocumented):

- ``_TrainingEpochLoop._should_accumulate()``: whether the micro-batch in training steps the optimizer (the quorum
  request starts only on the one that does).
- ``_TrainingEpochLoop._should_check_val_fx(data_fetcher)``: replaced to validate at job-wide steps.
- ``_TrainingEpochLoop._update_learning_rates(interval, update_plateau_schedulers)``: replaced so Lightning steps
  only plateau schedulers; the strategy steps the others by job-wide counts.
- ``_TrainingEpochLoop._batches_that_stepped``: the logging step, a job-wide counter that catch-up transfers.
- ``_FitLoop._data_fetcher``: the training data iterator, restarted at a group's new stream position.
- ``epoch_loop.automatic_optimization.optim_progress.optimizer.step`` and
  ``epoch_loop.manual_optimization.optim_step_progress``: the optimizer-step trackers ``trainer.global_step`` reads
  (``total.completed``), set by catch-up and a replayed step.
- ``epoch_loop.scheduler_progress``: the scheduler-step tracker, a job-wide counter that catch-up transfers.
- ``epoch_loop.batch_progress.current``, ``fit_loop.epoch_progress``, ``epoch_loop.batch_idx``: the batch index and
  epoch a group's stream position sets, and that a replayed step reports.
- the trackers' fields ``ready``, ``started``, ``processed``, ``completed`` and ``increment_ready()`` /
  ``increment_completed()``.

Lightning, behaviours (public members, undocumented behaviour):

- ``is_overridden("configure_model", module)`` counts a ``configure_model`` set on the instance, so Lightning calls the
  sharding policy the strategy installs there (``sharding.py``).
- ``LightningModule.log_dict`` logs through ``self.log``, so recording ``log`` also records ``log_dict``
  (``deferred_logs.py``).

torch (FSDP2 and ``nn.Module``), for running a step inside the root unit's ``forward`` (``root_forward.py``):

- ``FSDPModule._get_fsdp_state()``, ``FSDPState._pre_forward_hook_handle`` / ``_post_forward_hook_handle``: the
  root unit's own forward hooks, muted while a step runs inside its ``forward``.
- ``nn.Module._forward_pre_hooks`` / ``_forward_hooks``: the hook dictionaries, keyed by the handles' ``id``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.data import _update_dataloader
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    from lightning.pytorch.loops.progress import _ProcessedTracker, _Progress, _ReadyCompletedTracker

# ------------------------------------------------------------------------------------------- strategy and data


def shard_over_all_devices(strategy: ModelParallelStrategy, devices: int) -> None:
    """Make ``strategy.setup_environment`` build a mesh of ``devices`` data-parallel (sharding) ranks, no tensor
    parallelism. Call it before ``ModelParallelStrategy.setup_environment``."""
    strategy._data_parallel_size = devices
    strategy._tensor_parallel_size = 1


def with_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """``dataloader`` re-created with ``sampler``, as Lightning re-creates it to inject its own."""
    return _update_dataloader(dataloader, sampler)


def lightning_optimizer(trainer: pl.Trainer, index: int) -> LightningOptimizer:
    """The ``LightningOptimizer`` Lightning passes to the ``optimizer_step`` hook for optimizer ``index``."""
    return trainer.strategy._lightning_optimizers[index]


# ------------------------------------------------------------------------------------------------------- hooks


@contextmanager
def optimizer_step_hooks_off(trainer: pl.Trainer) -> Generator[None, None, None]:
    """Inside: a ``LightningOptimizer.step`` runs none of the manual loop's own hooks around the step (its count of
    optimizer steps, its profiler range)."""
    optimizers = list(trainer.strategy._lightning_optimizers)
    saved = [(o._on_before_step, o._on_after_step) for o in optimizers]
    for optimizer in optimizers:
        optimizer._on_before_step = optimizer._on_after_step = do_nothing_closure
    try:
        yield
    finally:
        for optimizer, (before, after) in zip(optimizers, saved, strict=True):
            optimizer._on_before_step, optimizer._on_after_step = before, after


def call_module_hook(trainer: pl.Trainer, hook_name: str, *args: Any) -> Any:
    """Call a LightningModule hook as Lightning calls it (profiled, with its name as ``_current_fx_name``)."""
    return call._call_lightning_module_hook(trainer, hook_name, *args)


@contextmanager
def logging_from(module: pl.LightningModule, hook_name: str) -> Generator[None, None, None]:
    """While inside, ``module.log`` accepts values as if logged from the hook ``hook_name``."""
    previous = module._current_fx_name
    module._current_fx_name = hook_name
    try:
        yield
    finally:
        module._current_fx_name = previous


# ----------------------------------------------------------------------------------------------- training loops


def is_accumulating(trainer: pl.Trainer) -> bool:
    """Whether the micro-batch now in training only accumulates gradients (no optimizer step follows it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def replace_validation_check(trainer: pl.Trainer, due: Callable[[Any], bool]) -> None:
    """Make the training loop validate after a batch when ``due(data_fetcher)`` says so, instead of by its schedule."""
    trainer.fit_loop.epoch_loop._should_check_val_fx = due  # type: ignore[method-assign]


def replace_scheduler_update(trainer: pl.Trainer, update: Callable[..., None]) -> Callable[..., None]:
    """Make the training loop call ``update(interval=..., update_plateau_schedulers=...)`` where it would step the LR
    schedulers; returns Lightning's own update (the class's, so it never calls ``update``)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    lightning_update = functools.partial(type(epoch_loop)._update_learning_rates, epoch_loop)
    epoch_loop._update_learning_rates = update  # type: ignore[method-assign]
    return lightning_update


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The logging step: batches that stepped the optimizer (the step Lightning logs metrics at)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: pl.Trainer, value: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def restart_training_iterator(trainer: pl.Trainer) -> None:
    """Start a fresh iterator over the training DataLoader (its sampler reads the start position again)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def optimizer_step_tracker(trainer: pl.Trainer) -> _ReadyCompletedTracker:
    """The tracker whose ``completed`` is ``trainer.global_step``: automatic and manual optimization count apart."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        return epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    return epoch_loop.manual_optimization.optim_step_progress.total


def scheduler_progress(trainer: pl.Trainer) -> _Progress:
    """The LR scheduler steps: ``total`` counts them over the fit, ``increment_*`` counts one."""
    return trainer.fit_loop.epoch_loop.scheduler_progress


def batch_tracker(trainer: pl.Trainer) -> _ProcessedTracker:
    """The batches of the current epoch (``ready - 1`` is ``batch_idx``)."""
    return cast("_ProcessedTracker", trainer.fit_loop.epoch_loop.batch_progress.current)


def epoch_trackers(trainer: pl.Trainer) -> tuple[_ProcessedTracker, _ProcessedTracker]:
    """The epoch trackers (``current`` and ``total``; ``trainer.current_epoch`` is ``current.completed``)."""
    progress = trainer.fit_loop.epoch_progress
    return cast("_ProcessedTracker", progress.current), cast("_ProcessedTracker", progress.total)


def batch_idx(trainer: pl.Trainer) -> int:
    """The index, inside its epoch, of the batch in training."""
    return trainer.fit_loop.epoch_loop.batch_idx


# ------------------------------------------------------------------------------------------------- torch FSDP2


def own_forward_hook_slots(module: FSDPModule) -> list[tuple[dict[int, Callable[..., Any]], int]]:
    """Where the FSDP2 unit's own forward pre-hook and forward hook sit: (the module's hook dictionary, key)."""
    assert isinstance(module, nn.Module)
    state = module._get_fsdp_state()
    return [(module._forward_pre_hooks, state._pre_forward_hook_handle.id),
            (module._forward_hooks, state._post_forward_hook_handle.id)]
