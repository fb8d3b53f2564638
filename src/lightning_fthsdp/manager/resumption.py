"""The steps that load a durable checkpoint instead of exchanging: a quorum that resumes from one (no live group held
the job's committed state: every member loads it, unless it holds that step already), and a relaunched job's first
step (``FTManager.resume_from_checkpoint``; not where a peer's newer state replaces ours anyway). Nobody exchanges in
such a step: every member trains it again once loaded, so the load happens where every front end already expects one.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_fthsdp.config import log
from lightning_fthsdp.manager.checkpoints import DurableCheckpoints
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.recovery.torch_state import StateTree


class Resumption:
    """``load(tree)`` applies a loaded checkpoint to the registered state; ``stop_following(why)`` ends a catch-up
    under way (a checkpoint's state replaces it)."""

    def __init__(self, checkpoints: DurableCheckpoints | None, replica_id: str, load: Callable[[StateTree], None],
                 stop_following: Callable[[str], None], rlog: log.ReplicaLogger) -> None:
        self._checkpoints, self._replica_id, self._load = checkpoints, replica_id, load
        self._stop_following, self._rlog = stop_following, rlog
        self._relaunch_step: int | None = None  # relaunch()'s step, loaded in the first exchange

    def relaunch(self, step: int, started: bool) -> None:
        """Resume the job from the checkpoint of ``step`` in the first step; ``started``: a step began already."""
        if self._checkpoints is None:
            raise ValueError(f"FTManager (group {self._replica_id}): resuming from the checkpoint of step {step} "
                             f"needs checkpoint_dir: give every group the folder the job's checkpoints are in")
        if started:
            raise RuntimeError(f"FTManager (group {self._replica_id}): resume_from_checkpoint({step}) after the first "
                               f"step began: call it before training")
        self._relaunch_step = step

    @property
    def relaunching(self) -> bool:
        """Whether the next exchange may load the relaunch checkpoint instead."""
        return self._relaunch_step is not None

    def instead_of_exchange(self, quorum: Quorum, step: int) -> bool:
        """Whether the step of ``quorum`` (this group holding committed ``step``) loads a checkpoint instead of
        exchanging (loaded here), or holds its state already in a quorum that resumes from one."""
        if quorum.resume_step >= 0:
            if step != quorum.resume_step:
                if self._checkpoints is None:
                    raise RuntimeError(
                        f"FTManager (group {self._replica_id}): quorum {quorum.quorum_id} resumes from the checkpoint "
                        f"of step {quorum.resume_step} ({quorum.resume_path}), but this group has no checkpoint_dir: "
                        f"give every group the same checkpoint settings")
                self._stop_following("the quorum resumes from a durable checkpoint")
                self._read(quorum.resume_step, "no live group holds the job's committed state: loading")
            return True
        if self._relaunch_step is None:
            return False
        relaunch, self._relaunch_step = self._relaunch_step, None
        if self._replica_id in quorum.catch_up_from:  # a peer's newer state replaces ours anyway
            return False
        self._read(relaunch, "the job resumes from")
        return True

    def _read(self, step: int, why: str) -> None:
        assert self._checkpoints is not None
        self._rlog.warning("%s the checkpoint of step %d from %s", why, step, self._checkpoints.root)
        self._checkpoints.load(step, self._load)
