"""StepDriver: one optimizer step through the fault-tolerant path until it commits, the same for every front end.

The front end computes the step's gradients and calls ``until_committed``. The driver exchanges them across the
replica groups and votes; a failed attempt (a group died during the exchange, this group's lease ran out, a
membership change) is tried again inside the same optimizer step, on the same batch: the weights did not change, and
the gradients are as computed (the average replaces them only once the group votes to commit). What an attempt adds
to them, the extra batches of a degraded step that keeps the global batch, is undone from a copy taken before the
first of them. After ``Timeouts.max_failed_commits`` failed attempts in a row ``FTManager.commit`` raises
``CommitsFailed``.

A parameter no contributing group had a gradient for is skipped by the optimizer, as without fault tolerance
(``manager.gradients``). When the commit loaded a catch-up state, the steps the group followed while the transfer
ran are applied first, each through the front end's ``apply`` with its averaged gradients in place; the front end's
own optimizer step then applies the committed one. What a front end adapts is only its optimizer step.

A front end that calls ``before_backward`` ahead of the backward of a step's last micro-batch has the exchange start
while that backward runs (``manager.overlap``); a retried attempt exchanges them all after backward. Under
FSDP2 the parameters to give are the sharded ones the module holds outside forward and backward (it holds others in
between): take them between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_fthsdp.config.ranges import REPLAY, span
from lightning_fthsdp.data.topology import DataTopology
from lightning_fthsdp.manager.gradients import ExchangedGradients
from lightning_fthsdp.manager.manager import FTManager
from lightning_fthsdp.manager.overlap import OverlappedExchange
from lightning_fthsdp.manager.step import HeldStep
from lightning_fthsdp.recovery.torch_state import local


@dataclass
class Committed:
    """What one ``until_committed`` call went through before its step committed."""

    stall_s: float = 0.0
    """Seconds from the first attempt to the one that committed (0 when the first committed)."""
    discarded: int = 0
    """Attempts that failed and were tried again."""
    followed: int = 0
    """Steps of the job this group followed (and held) while its catch-up transfer ran."""
    replayed: int = 0
    """Held steps applied before the committed one."""
    caught_up: bool = False
    """The commit loaded a peer's state: the group's data position and counters moved."""
    resumed: bool = False
    """A durable checkpoint was loaded during the step: the gradients were computed again (``retrain``)."""


class StepDriver:
    """Runs one rank's steps through exchange and commit vote, until each commits.

    Args:
        manager: this rank's ``FTManager`` (the had-gradient flags go to its ``device``, the gradients').
        apply: how the front end applies a held step (its optimizer step, clipping, scheduler): with it, a
            catching-up group follows the job instead of making the healthy groups wait for its transfer
            (``FTManager.enable_replay``). None: the transfer ends inside the step the group joined.
        topology: the job's data topology: a quorum of more groups than data streams is refused.
        phase: failure injection, called with ``"before"`` (or ``"follow"`` while following) ahead of each
            exchange and ``"commit"`` ahead of each vote.
    """

    def __init__(self, manager: FTManager, *, apply: Callable[[HeldStep], None] | None = None,
                 topology: DataTopology | None = None, phase: Callable[[str], None] | None = None) -> None:
        self._manager, self._apply, self._topology = manager, apply, topology
        self._phase = phase or (lambda _: None)
        self._exchanged = ExchangedGradients([], manager.device)
        self._overlap: OverlappedExchange | None = None
        if apply is not None:
            manager.enable_replay()

    def before_backward(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Ahead of the backward of a step's last micro-batch (on every rank of the group, it agrees on the step's
        quorum): start exchanging the gradients of ``params`` as that backward produces them, where the step allows
        (``FTManager.open_exchange``). Pass the same ``params`` to ``until_committed``."""
        params = list(params)
        if self._overlap is None or not _same(self._overlap.params, params):
            if self._overlap is not None:
                self._overlap.remove()
            self._overlap = OverlappedExchange(params)
        exchange = self._manager.open_exchange()
        if exchange is not None:
            self._overlap.arm(exchange)

    def close(self) -> None:
        """Take ``before_backward``'s hooks off the parameters."""
        if self._overlap is not None:
            self._overlap.remove()
            self._overlap = None

    def until_committed(self, params: Sequence[torch.nn.Parameter], *,
                        train_extra_batches: Callable[[int], None] | None = None,
                        retrain: Callable[[], None] | None = None,
                        on_uncommitted: Callable[[str], None] | None = None,
                        extra: Sequence[torch.Tensor] = ()) -> Committed:
        """Exchange the gradients of ``params`` (and the ``extra`` tensors, the same in every group) and vote until
        the step commits; on return the averaged gradients are in place and the held steps applied.

        ``train_extra_batches(n)`` trains this group's ``n`` extra batches of an attempt (a degraded step with the
        global batch kept, ``FTManager(global_batches=...)``; 0 otherwise); their gradients add to the step's.
        ``retrain()`` computes the step's gradients afresh from none, at the group's committed position: a quorum had
        this group load a durable checkpoint (the weights and the position changed). ``on_uncommitted(kind)`` after
        each attempt that did not commit: ``"follow"`` (the group followed the job's step) or ``"discard"``.
        Raises ValueError on a quorum larger than the topology, RuntimeError on a checkpoint load without
        ``retrain``, CommitsFailed once the manager's budget of failed commits in a row is spent."""
        manager, params = self._manager, list(params)
        if self._overlap is not None and self._overlap.armed and not _same(self._overlap.params, params):
            raise RuntimeError(f"StepDriver (group {manager.replica_id}): the trained parameters changed between the "
                               f"step's backward, which started exchanging their gradients, and its exchange (a "
                               f"requires_grad changed inside the step?): change them between steps, or turn the "
                               f"overlapped exchange off (overlap_exchange=False)")
        ours: list[torch.Tensor | None] | None = None  # the step's own gradients, before any extra batches
        loads, catch_ups = manager.checkpoint_loads, len(manager.catch_up_log)
        result, started = Committed(), time.monotonic()
        self._exchanged = ExchangedGradients(params, manager.device)
        while True:
            if train_extra_batches is not None:
                extra_batches = manager.step_batches() - 1
                if extra_batches and ours is None:
                    ours = self._copy(params)
                train_extra_batches(extra_batches)
            tensors = [*self._exchanged.tensors(), *extra]
            self._phase("follow" if manager.following else "before")
            manager.sync_gradients(tensors)
            if self._overlap is not None:
                self._overlap.disarm()  # a retried attempt exchanges after backward
            if self._topology is not None and manager.quorum is not None:
                self._topology.check_quorum(manager.quorum.member_ids, manager.replica_id)
            self._phase("commit")
            step_before = manager.step
            if manager.commit():
                break
            result.stall_s = time.monotonic() - started
            kind = "follow" if manager.step > step_before else "discard"
            result.followed += kind == "follow"
            result.discarded += kind == "discard"
            if on_uncommitted is not None:
                on_uncommitted(kind)
            if manager.checkpoint_loads != loads:
                if retrain is None:
                    raise RuntimeError(f"StepDriver (group {manager.replica_id}): a durable checkpoint was loaded "
                                       "during the step: pass retrain= to until_committed to compute its gradients "
                                       "again from the loaded state")
                loads, result.resumed = manager.checkpoint_loads, True
                retrain()
                ours, self._exchanged = None, ExchangedGradients(params, manager.device)
            elif ours is not None:
                self._restore(params, ours)
        result.caught_up = len(manager.catch_up_log) > catch_ups
        held = manager.take_held()
        if held:
            with span(REPLAY):
                self._replay(tensors, held)
            result.replayed = len(held)
        self._exchanged.drop_missing()
        return result

    def _replay(self, tensors: list[torch.Tensor], held: list[HeldStep]) -> None:
        """Apply each held step through ``apply`` with its averaged tensors in place of this step's, then put this
        step's back."""
        assert self._apply is not None, "steps are held only with apply (FTManager.enable_replay)"
        current = [t.detach().clone() for t in tensors]
        for step in held:
            for tensor, grad in zip(tensors, step.grads, strict=True):
                tensor.detach().copy_(grad)
            self._exchanged.drop_missing()
            self._apply(step)
        for tensor, grad in zip(tensors, current, strict=True):
            tensor.detach().copy_(grad)

    @staticmethod
    def _copy(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        """This rank's gradient shards before an attempt's extra batches (None: no gradient)."""
        return [local(p.grad).clone() if p.grad is not None else None for p in params]

    @staticmethod
    def _restore(params: list[torch.nn.Parameter], ours: list[torch.Tensor | None]) -> None:
        for p, own in zip(params, ours, strict=True):
            if own is None:
                p.grad = None
            else:
                local(p.grad).copy_(own)


def _same(ours: Sequence[torch.nn.Parameter], theirs: Sequence[torch.nn.Parameter]) -> bool:
    return len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs, strict=True))
