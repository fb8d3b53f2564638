"""Lightning's loop counters as catch-up state, moving them to a replica group's own data position, taking the LR
scheduler cadence over from Lightning, and replaying an optimizer step held during catch-up.

Everything here touches Lightning's loop progress objects (public attributes of its loops, but not a documented
API); it is kept in one module so a Lightning upgrade has one place to check.

Two kinds of counters, two sources:

- job-wide counters (the optimizer step count, i.e. ``global_step``, the logging step, the LR scheduler step
  count) are the same in every healthy group and travel from the catch-up source;
- stream counters (the epoch and the batch index inside it) describe this group's own data stream and are
  derived from its own position (``FTManager.next_batch_index``), see ``align_to_stream``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.types import LRSchedulerConfig

from lightning_fthsdp.recovery.torch_state import StateTree


def _step_progress(trainer: pl.Trainer) -> Any:
    """The tracker ``trainer.global_step`` reads: automatic and manual optimization count steps apart."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        return epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    return epoch_loop.manual_optimization.optim_step_progress.total


def job_counters(trainer: pl.Trainer) -> StateTree:
    """The job-wide counters at a step boundary (read on the serving group while its step is in flight)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return {
        "global_step": _step_progress(trainer).completed,
        "batches_that_stepped": epoch_loop._batches_that_stepped,
        "scheduler_steps": epoch_loop.scheduler_progress.total.completed,
    }


def load_job_counters(trainer: pl.Trainer, tree: StateTree) -> None:
    """Become the source's counters in the middle of the step being committed.

    Called inside ``optimizer_step``: Lightning has already counted this step as ready and will count it completed
    when ``optimizer_step`` returns, so ``completed`` is the source's value and ``ready`` one more.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    step = _step_progress(trainer)
    step.completed = int(tree["global_step"])
    step.ready = step.completed + 1
    epoch_loop._batches_that_stepped = int(tree["batches_that_stepped"])
    scheduler = epoch_loop.scheduler_progress.total
    scheduler.ready = scheduler.completed = int(tree["scheduler_steps"])


def align_to_stream(trainer: pl.Trainer, epoch: int, offset: int) -> None:
    """Make Lightning's epoch and in-epoch batch index those of the stream position (epoch, offset) that the
    next batch comes from, and restart the training data iterator there.

    Called inside ``optimizer_step`` of a committed step (after Lightning counted the batch ready and started,
    before it counts it processed and completed), so the counters are set one below their target.
    """
    fit_loop = trainer.fit_loop
    for tracker in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
        tracker.ready = tracker.started = epoch + 1
        tracker.processed = tracker.completed = epoch
    batch = fit_loop.epoch_loop.batch_progress.current
    batch.ready = batch.started = offset
    batch.processed = batch.completed = offset - 1
    fetcher: Any = fit_loop._data_fetcher  # no public way to restart the epoch's iterator
    if fetcher is not None:
        iter(fetcher)  # a fresh DataLoader iterator: the sampler reads the new start position


def take_over_schedulers(trainer: pl.Trainer) -> list[LRSchedulerConfig]:
    """Stop Lightning from stepping the LR schedulers it would step by this group's own batch index and epoch (which
    differ between groups once one has restarted), returning their configs for the strategy to step by job-wide
    counts instead. ``ReduceLROnPlateau`` schedulers (stepped on a monitored metric) are left to Lightning."""
    epoch_loop = trainer.fit_loop.epoch_loop
    lightning_update = functools.partial(type(epoch_loop)._update_learning_rates, epoch_loop)

    def plateau_only(interval: str, update_plateau_schedulers: bool) -> None:
        # Lightning's own update handles plateau schedulers only when asked for them, the others only when not.
        if update_plateau_schedulers:
            lightning_update(interval=interval, update_plateau_schedulers=True)

    epoch_loop._update_learning_rates = plateau_only  # type: ignore[method-assign]
    return [config for config in trainer.lr_scheduler_configs if not config.reduce_on_plateau]


def validate_at_job_steps(trainer: pl.Trainer, every_n_steps: int) -> None:
    """Run Lightning's validation loop after every committed step that is a multiple of ``every_n_steps`` (0: none)
    and after the last one (``max_steps``, if set), instead of at this group's own batch counts and epoch ends
    (which differ between groups once one has restarted): every group validates the same committed steps. A group
    that reaches a step by catching up (its counter jumps past a multiple) does not validate the steps it skipped."""
    epoch_loop = trainer.fit_loop.epoch_loop
    last = [trainer.global_step]

    def due(data_fetcher: Any) -> bool:
        step = trainer.global_step
        if step == last[0]:
            return False  # an accumulation micro-batch: nothing was committed
        last[0] = step
        multiple = every_n_steps > 0 and step % every_n_steps == 0
        return trainer.enable_validation and (multiple or step == trainer.max_steps)

    epoch_loop._should_check_val_fx = due  # type: ignore[method-assign]


def step_scheduler(trainer: pl.Trainer, config: LRSchedulerConfig) -> None:
    """Step one scheduler as Lightning would (through the LightningModule's ``lr_scheduler_step`` hook)."""
    progress = trainer.fit_loop.epoch_loop.scheduler_progress
    progress.increment_ready()
    call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
    progress.increment_completed()


def replay_optimizer_step(trainer: pl.Trainer, closure: Callable[[], Any]) -> None:
    """Run the LightningModule's ``optimizer_step`` hook for a step whose gradients are in place already (held during
    catch-up), with this group's epoch and batch index. Called inside the current step's ``optimizer_step`` hook:
    directly, not through Lightning's hook caller (whose profiler refuses a hook nested in itself)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    optimizer = trainer.strategy._lightning_optimizers[0]
    trainer.lightning_module.optimizer_step(trainer.current_epoch, epoch_loop.batch_idx, optimizer, closure)


def count_replayed_step(trainer: pl.Trainer) -> None:
    """Count a replayed step as Lightning counts a completed optimizer step."""
    epoch_loop = trainer.fit_loop.epoch_loop
    step = _step_progress(trainer)
    step.ready += 1  # the step in flight stays counted as ready: it completes when its optimizer_step returns
    step.completed += 1
    epoch_loop._batches_that_stepped += 1
