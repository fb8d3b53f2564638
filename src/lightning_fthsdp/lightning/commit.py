"""StepCommit: one optimizer step's gradients exchanged across the replica groups, retried until a commit succeeds
(or ``Timeouts.max_failed_commits`` attempts in a row failed: ``FTManager.commit`` then raises ``CommitsFailed``).

A discarded attempt (a group died during the exchange, this group's lease ran out) is retried inside the same
optimizer step, on the same batch: the weights did not change, so the gradient is restored from a copy made before
the first attempt (one copy of this rank's gradient shards per step), and a degraded step's extra batches are
trained again.

A parameter no contributing group had a gradient for is skipped by the optimizer, as without fault tolerance
(``manager.gradients``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lightning_fthsdp.data.topology import DataTopology
from lightning_fthsdp.lightning.deferred_logs import DeferredLogs
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.manager.gradients import ExchangedGradients
from lightning_fthsdp.recovery.torch_state import local


class StepCommit:
    """Runs a step's exchange and commit vote until the step commits (``until_committed``).

    Args:
        manager: this rank's ``FTManager``.
        topology: the job's data topology (a larger quorum is refused: data shards would overlap).
        device: where the had-gradient flags are exchanged (the gradients' device).
        logs: the step's held ``self.log`` calls; those of a discarded attempt's extra batches are forgotten.
        fire_fault: failure injection, called with the phase "before" ahead of each exchange.
    """

    def __init__(self, manager: FTManager, topology: DataTopology, device: torch.device, logs: DeferredLogs,
                 fire_fault: Callable[[str], None]) -> None:
        self._manager, self._topology, self._device = manager, topology, device
        self._logs, self._fire_fault = logs, fire_fault
        self.caught_up = False
        """Whether the last commit loaded a peer's state (set through ``mark_caught_up``)."""
        self.resumed = False
        """Whether the last commit's quorum had this group load a durable checkpoint."""
        self._exchanged = ExchangedGradients([], device)  # the last step's

    def mark_caught_up(self) -> None:
        """Called by the loop-counter loader of catch-up, inside the commit that loads a peer's state."""
        self.caught_up = True

    def until_committed(self, params: list[torch.nn.Parameter], train_extra_batches: Callable[[int], None],
                        retrain: Callable[[], None] | None = None) -> float:
        """Exchange the gradients of ``params`` and vote, until the step commits; returns the seconds spent in
        discarded attempts. ``train_extra_batches(n)`` trains this group's ``n`` extra batches of the attempt (a
        degraded step with ``keep_global_batch``; 0 otherwise). ``retrain()`` computes the step's gradients afresh
        (after the quorum had this group load a durable checkpoint: the weights and the data position changed).
        Raises ValueError on a quorum larger than the job, CommitsFailed once the manager's budget of failed commits
        in a row is spent."""
        manager = self._manager
        ours = [local(p.grad).clone() if p.grad is not None else None for p in params]
        loads, resumed = manager.checkpoint_loads, False
        logged = self._logs.mark()
        started, stall_s = time.monotonic(), 0.0
        while True:
            train_extra_batches(manager.step_batches() - 1)
            self._exchanged = ExchangedGradients(params, self._device)
            tensors = self._exchanged.tensors()
            self._fire_fault("before")
            manager.sync_gradients(tensors)
            if manager.quorum is not None:
                self._topology.check_quorum(manager.quorum.member_ids, manager.replica_id)
            self.caught_up = False
            if manager.commit():
                break
            if manager.checkpoint_loads != loads and retrain is not None:
                loads, resumed = manager.checkpoint_loads, True
                retrain()
                ours = [local(p.grad).clone() if p.grad is not None else None for p in params]
                stall_s = time.monotonic() - started
                continue
            for p, own in zip(params, ours, strict=True):
                if own is None:
                    p.grad = None
                else:
                    local(p.grad).copy_(own)
            self._logs.rewind(logged)  # the extra batches are trained (and log) again
            stall_s = time.monotonic() - started
        self.resumed = resumed
        self.drop_missing_gradients()
        return stall_s

    def drop_missing_gradients(self) -> None:
        """After the exchange (``ExchangedGradients.drop_missing``)."""
        self._exchanged.drop_missing()
