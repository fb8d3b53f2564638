"""The catching-up side of catch-up: fetch the state in the background, follow the job while the transfer runs on
(contributing zeros, holding each step's averaged gradients), then load the state and hand back the steps held."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lightning_fthsdp.config import anatomy, log
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.sources import sources
from lightning_fthsdp.manager.step import HeldStep, Progress
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.recovery.catchup import CatchUp
from lightning_fthsdp.recovery.torch_state import StateTree
from lightning_fthsdp.recovery.wire import split_tree


@dataclass
class _Follow:
    """A catch-up in progress: the state transfer, and the steps the group followed while it ran (if it outlasts
    the step it began in)."""

    source: str
    """The source the quorum assigned (others are tried should it fail)."""
    base_step: int
    """The step whose state is in transfer."""
    own_step: int
    own_committed_in: int
    """What this group held before (restored if the transfer fails)."""
    started: float
    updates: list[tuple[list[torch.Tensor], dict[str, int]]] = field(default_factory=list)
    """Every step since: the job's averaged gradients and batch shares, replayed once the state arrives."""
    nbytes: int = 0
    tree: StateTree | None = None
    delivered_by: str = ""
    """The source whose state arrived."""
    failed: bool = False
    """The transfer ended without the state: the group stops following at the commit vote."""
    loading: Future[None] | None = None
    """The load of ``tree`` on the catch-up thread, begun once every rank of the group held it (``begin_load``)."""


class Follower:
    """At most one catch-up of this rank, moving ``progress`` along with it: while following, ``progress.step``
    counts the steps held (what the quorum request reports); a dropped catch-up restores what the group held."""

    def __init__(
        self,
        catchup: CatchUp,
        progress: Progress,
        progress_entry: str,
        shard_rank: int,
        timeouts: Timeouts,
        rlog: log.ReplicaLogger,
        *,
        replay_budget: int,
        keep_memory: bool,
    ) -> None:
        self._catchup = catchup
        self._progress = progress
        self._progress_entry = progress_entry  # the registered state ``progress`` loads from: on the step's thread
        self._shard_rank = shard_rank
        self._timeout_s = timeouts.collective_timeout_ms / 1000
        self._rlog = rlog
        self._replay_budget = replay_budget
        self._keep_memory = keep_memory
        self._follow: _Follow | None = None
        self.catch_up_log: list[dict[str, object]] = []
        """One entry per catch-up of this group: source, step loaded, bytes (of this rank's state fetched), fetch_s
        (seconds the fetch took), replayed."""

    @property
    def active(self) -> bool:
        return self._follow is not None

    @property
    def loading(self) -> bool:
        """Whether the fetched state is being (or has been) loaded on the catch-up thread."""
        return self._follow is not None and self._follow.loading is not None

    @property
    def failed(self) -> bool:
        """Whether this step's wait for the transfer ended without the state."""
        return self._follow is not None and self._follow.failed

    def start(self, quorum: Quorum, source: str) -> None:
        """The quorum names this group behind ``source``: fetch the state of ``quorum.max_step`` from it."""
        progress, follow = self._progress, self._follow
        if follow is not None and (follow.source, follow.base_step) == (source, quorum.max_step) and not follow.updates:
            return  # a failed step behind us, nothing followed yet: the same transfer runs on
        self.stop(f"the quorum names us behind again (at step {progress.step})")
        self._catchup.start_fetch(sources(quorum, source, self._shard_rank), quorum.max_step,
                                  timeout_s=self._timeout_s)
        if progress.step == quorum.max_step:
            self._rlog.warning("our step %d was committed in quorum %d, whose exchange the others abandoned and "
                               "trained again: taking their state from %s", progress.step, progress.committed_in,
                               source)
        else:
            self._rlog.info("behind at step %d: fetching step %d from %s", progress.step, quorum.max_step, source)
        self._follow = _Follow(source, quorum.max_step, progress.step, progress.committed_in, time.monotonic())

    def poll(self, can_replay: bool) -> bool:
        """Whether this rank holds the fetched state. It waits for the transfer once the replay buffer is full, at
        once without ``can_replay``: then waiting for the rest of a transfer that ran during the whole step costs
        the healthy groups less than a retry would (a fresh snapshot, everything transferred again)."""
        follow = self._follow
        assert follow is not None, "poll() while following"
        budget = self._replay_budget if can_replay else 0
        if follow.loading is not None:
            if not follow.loading.done() and follow.nbytes < budget:
                return False
            self._wait_loaded(follow)  # a loader's error ends the group here, on the step's thread
            return True
        if follow.tree is None and (self._catchup.fetch_done() or follow.nbytes >= budget):
            if follow.updates and not self._catchup.fetch_done():
                self._rlog.warning("replay buffer full (%d steps, %d MiB): waiting for the state of step %d",
                                   len(follow.updates), follow.nbytes >> 20, follow.base_step)
            fetched = self._catchup.finish_fetch(timeout_s=self._timeout_s)
            if fetched is not None:
                follow.tree, follow.delivered_by = fetched.tree, fetched.source
                anatomy.mark("fetched")
            follow.failed = fetched is None
        return follow.tree is not None

    def hold(self, tensors: Sequence[torch.Tensor], shares: dict[str, int], quorum_id: int) -> None:
        """Follow the job through a step the state has not arrived for yet: keep its averaged gradients."""
        follow = self._follow
        assert follow is not None, "hold() while following"
        grads = [t.detach().clone() for t in tensors]
        follow.updates.append((grads, dict(shares)))
        follow.nbytes += sum(g.numel() * g.element_size() for g in grads)
        self._progress.step = follow.base_step + len(follow.updates)  # the steps we will hold once the state is in
        self._progress.committed_in = quorum_id

    def begin_load(self, can_replay: bool) -> bool:
        """Every rank of the group holds the fetched state (the commit vote): load it on the catch-up thread while the
        group follows on, holding each step, rather than in this step, whose copy the healthy groups would wait for
        in their next exchange. Its own progress stays put until ``load``: the follow moves it meanwhile. Returns
        False, and begins nothing (``load`` loads it all now), when the replay buffer has no room for another step,
        or when the state arrived in the step that asked for it: a transfer that short is of a state quick to load,
        and the group commits at once (a restart near the job's end finishes with it)."""
        follow = self._follow
        assert follow is not None and follow.tree is not None and follow.loading is None, "begin_load() once held"
        if not can_replay or not follow.updates or follow.nbytes >= self._replay_budget:
            return False
        follow.loading = self._catchup.load_in_background(follow.tree, keep_memory=self._keep_memory,
                                                          skip=(self._progress_entry,))
        return True

    def load(self) -> list[HeldStep]:
        """Load the fetched state (if ``begin_load`` did not: the rest of it) and hand back the steps held since,
        numbered from the loaded step on: the caller applies each (its averaged gradients) before the optimizer step
        of the step being committed."""
        follow = self._follow
        assert follow is not None and follow.tree is not None, "load() once the state is held"
        self._follow = None
        nbytes = sum(t.numel() * t.element_size() for t in split_tree(follow.tree)[1])
        if follow.loading is None:
            self._catchup.load(follow.tree, keep_memory=self._keep_memory)
        else:
            self._finish_load(follow)
        held = []
        for grads, shares in follow.updates:
            self._progress.advance(shares)
            held.append(HeldStep(self._progress.step, shares, grads))
        anatomy.mark("replayed")
        self.catch_up_log.append({"source": follow.delivered_by, "step": follow.base_step, "bytes": nbytes,
                                  "fetch_s": time.monotonic() - follow.started, "replayed": len(held)})
        self._rlog.info("caught up: loaded the state of step %d from %s, %d held steps to replay", follow.base_step,
                        follow.delivered_by, len(held))
        return held

    def _finish_load(self, follow: _Follow) -> None:
        """The background load done: the progress loads last, here on the step's thread (the follow moved it)."""
        assert follow.tree is not None, "a load begins once the state is held"
        self._wait_loaded(follow)
        self._catchup.load_entry(follow.tree, self._progress_entry)

    def _wait_loaded(self, follow: _Follow) -> None:
        """Wait for the background load (raising a loader's error), up to the collective timeout: a load that takes
        longer is stuck, and the live state is neither ours nor the fetched one, so the group must restart."""
        assert follow.loading is not None, "a load began"
        try:
            follow.loading.result(timeout=self._timeout_s)
        except futures.TimeoutError as exc:
            raise RuntimeError(f"loading the fetched state of step {follow.base_step} took over {self._timeout_s:g} "
                               f"s (collective_timeout_ms) on the catch-up thread: a registered load function is "
                               f"stuck; the group's live state is torn, so it must restart (its launcher restarts "
                               f"it)") from exc

    def stop(self, reason: str) -> None:
        """Drop the catch-up (if any): cancel the transfer, back at the group's own step."""
        follow = self._follow
        if follow is None:
            return
        self._follow = None
        self._catchup.cancel_fetch()
        if follow.loading is not None:
            # The live state is the fetched one now (a load is never half undone): the group holds the fetched
            # step, as if from a checkpoint (no commit of its own: the lighthouse holds it to the job's step).
            self._finish_load(follow)
            self._progress.committed_in = -1
            self._rlog.warning("%s: dropping the catch-up from %s (%d steps held) after loading its state, now at "
                               "its step %d", reason, follow.source, len(follow.updates), self._progress.step)
            return
        self._progress.step, self._progress.committed_in = follow.own_step, follow.own_committed_in
        self._rlog.warning("%s: dropping the catch-up from %s (%d steps held), back at our own step %d", reason,
                           follow.source, len(follow.updates), self._progress.step)
