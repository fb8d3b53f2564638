"""Lightning's loop counters under fault tolerance: catch-up state, a group's own data position, validation at
job-wide steps, and the replay of an optimizer step held during catch-up.

Two kinds of counters, two sources:

- job-wide counters (the optimizer step count, i.e. ``global_step``, the logging step, the LR scheduler step
  count) are the same in every healthy group and travel from the catch-up source;
- stream counters (the epoch and the batch index inside it) describe this group's own data stream and are
  derived from its own position (``FTManager.next_batch_index``), see ``align_to_stream``.

The loops' progress objects are undocumented: they are reached through ``private``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_fthsdp.lightning import private
from lightning_fthsdp.recovery.torch_state import StateTree


def job_counters(trainer: pl.Trainer) -> StateTree:
    """The job-wide counters at a step boundary (read on the serving group while its step is in flight)."""
    return {
        "global_step": private.optimizer_step_tracker(trainer).completed,
        "batches_that_stepped": private.batches_that_stepped(trainer),
        "scheduler_steps": private.scheduler_progress(trainer).total.completed,
    }


def load_job_counters(trainer: pl.Trainer, tree: StateTree) -> None:
    """Become the source's counters in the middle of the step being committed.

    Called inside ``optimizer_step``: Lightning has already counted this step as ready and will count it completed
    when ``optimizer_step`` returns, so ``completed`` is the source's value and ``ready`` one more.
    """
    step = private.optimizer_step_tracker(trainer)
    step.completed = int(tree["global_step"])
    step.ready = step.completed + 1
    private.set_batches_that_stepped(trainer, int(tree["batches_that_stepped"]))
    scheduler = private.scheduler_progress(trainer).total
    scheduler.ready = scheduler.completed = int(tree["scheduler_steps"])


def align_to_stream(trainer: pl.Trainer, epoch: int, offset: int) -> None:
    """Make Lightning's epoch and in-epoch batch index those of the stream position (epoch, offset) that the
    next batch comes from, and restart the training data iterator there.

    Called inside ``optimizer_step`` of a committed step (after Lightning counted the batch ready and started,
    before it counts it processed and completed), so the counters are set one below their target.
    """
    for tracker in private.epoch_trackers(trainer):
        tracker.ready = tracker.started = epoch + 1
        tracker.processed = tracker.completed = epoch
    batch = private.batch_tracker(trainer)
    batch.ready = batch.started = offset
    batch.processed = batch.completed = offset - 1
    # A fresh DataLoader iterator, so the sampler reads the new position. Making one draws its base seed from the
    # global RNG, which an uninterrupted run does not do here: the draw must not move the module's random numbers
    # (dropout) away from that run's.
    with torch.random.fork_rng(devices=[]):
        private.restart_training_iterator(trainer)


def validate_at_job_steps(trainer: pl.Trainer, every_n_steps: int) -> None:
    """Run Lightning's validation loop after every committed step that is a multiple of ``every_n_steps`` (0: none)
    and after the last one (``max_steps``, if set), instead of at this group's own batch counts and epoch ends
    (which differ between groups once one has restarted): every group validates the same committed steps. A group
    that reaches a step by catching up (its counter jumps past a multiple) does not validate the steps it skipped."""
    last = [trainer.global_step]

    def due(data_fetcher: Any) -> bool:
        step = trainer.global_step
        if step == last[0]:
            return False  # an accumulation micro-batch: nothing was committed
        last[0] = step
        multiple = every_n_steps > 0 and step % every_n_steps == 0
        return trainer.enable_validation and (multiple or step == trainer.max_steps)

    private.replace_validation_check(trainer, due)


def replay_optimizer_step(trainer: pl.Trainer, closure: Callable[[], Any]) -> None:
    """Run the LightningModule's ``optimizer_step`` hook for a step whose gradients are in place already (held during
    catch-up), with this group's epoch and batch index. Called inside the current step's ``optimizer_step`` hook:
    directly, not through Lightning's hook caller (whose profiler refuses a hook nested in itself)."""
    optimizer = private.lightning_optimizer(trainer, 0)
    trainer.lightning_module.optimizer_step(trainer.current_epoch, private.batch_idx(trainer), optimizer, closure)


def count_replayed_step(trainer: pl.Trainer) -> None:
    """Count a replayed step as Lightning counts a completed optimizer step."""
    step = private.optimizer_step_tracker(trainer)
    step.ready += 1  # the step in flight stays counted as ready: it completes when its optimizer_step returns
    step.completed += 1
    private.set_batches_that_stepped(trainer, private.batches_that_stepped(trainer) + 1)
