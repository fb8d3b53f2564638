"""A replica group's durable checkpoints under the fault-tolerant path: when to write one, who writes it, and loading
the one a quorum resumes from (see :mod:`~lightning_fthsdp.recovery.checkpoint` for the format).

Every ``every_n_steps`` committed steps one contributing group writes the registered state (the same state a
catching-up group fetches): the participant with the lowest replica id of the quorum the step was committed in. Every
group derives the same choice from the quorum, so none waits for another, and every shard rank of the writer writes
its own shard. The writer's leader reports each complete checkpoint to the lighthouse; when no live group holds the
committed step, the lighthouse answers a quorum with ``resume_step`` and every member loads that checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lightning_fthsdp.config import log
from lightning_fthsdp.membership.client import CheckpointReporter
from lightning_fthsdp.membership.connection import LighthouseRejected, LighthouseUnavailable
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.recovery.checkpoint import CheckpointInfo, CheckpointWriter, read_shard
from lightning_fthsdp.recovery.expected import expect
from lightning_fthsdp.recovery.torch_state import StateTree


def is_writer(quorum: Quorum, replica_id: str) -> bool:
    """Whether ``replica_id`` writes the checkpoint of a step committed in ``quorum``: the lowest participant (a
    member still catching up holds no state of its own)."""
    return bool(quorum.participants) and replica_id == min(quorum.participants)


class DurableCheckpoints:
    """One rank's side of durable checkpoints (``FTManager(checkpoint_dir=...)``)."""

    def __init__(self, root: str | Path, *, every_n_steps: int, keep: int, replica_id: str, rank: int,
                 shard_count: int, capture: Callable[[], StateTree], rlog: log.ReplicaLogger,
                 reporter: CheckpointReporter | None) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0:
            raise ValueError(f"FTManager checkpoint_every_n_steps must be an integer >= 0 (0: write none, only load "
                             f"the one a quorum resumes from), got {every_n_steps!r}")
        self.root = Path(root)
        self._every, self._replica_id, self._rank, self._shard_count = every_n_steps, replica_id, rank, shard_count
        self._capture, self._rlog, self._reporter = capture, rlog, reporter
        self._writer = CheckpointWriter(self.root, keep=keep, shard_rank=rank, shard_count=shard_count,
                                        replica_id=replica_id, capture=capture, log=rlog, on_complete=self._report)
        self._last = -1
        self.loads = 0
        """Checkpoints this rank loaded (a front end retrains the step it computed before a load)."""

    def at_step_boundary(self, step: int, quorum: Quorum | None, committed_in: int,
                         agree: Callable[[bool], bool]) -> None:
        """The state of committed ``step`` is live now (before the next step's forward): start its checkpoint if one
        is due and this group writes it. ``agree(free)`` is true on every rank of the group if every rank's writer is
        free: the shard ranks write a checkpoint together or skip it together (one shard missing would keep the
        others waiting for it)."""
        if (self._every and step > 0 and step % self._every == 0 and step != self._last and quorum is not None
                and committed_in == quorum.quorum_id and is_writer(quorum, self._replica_id)):
            self._last = step
            if agree(not self._writer.busy):
                self._writer.start(step)
            else:
                self._rlog.warning("checkpoint of step %d skipped: a rank of this group still writes the previous "
                                   "one", step)

    def wait_copied(self, timeout_s: float) -> None:
        """Before the optimizer step: the checkpoint's snapshot must not see it."""
        self._writer.wait_copied(timeout_s)

    def load(self, step: int, apply: Callable[[StateTree], None]) -> None:
        """Load this rank's shard of the checkpoint of ``step`` into the registered state (``apply``). Raises
        CheckpointError when it is missing, partial or unlike this rank's state."""
        tree = read_shard(self.root, step, self._rank, self._shard_count, expect(self._capture()))
        apply(tree)
        self.loads += 1
        self._last = step  # the state is the checkpoint's: writing it again would add nothing

    def close(self, timeout_s: float) -> None:
        self._writer.close(timeout_s)
        if self._reporter is not None:
            self._reporter.close()

    def _report(self, info: CheckpointInfo) -> None:
        if self._reporter is None:
            return
        try:
            self._reporter.report(info.step, str(info.path))
        except (LighthouseUnavailable, LighthouseRejected) as exc:
            # The checkpoint is on disk either way; the lighthouse learns of the next one.
            self._rlog.warning("could not report the checkpoint of step %d to the lighthouse: %s", info.step, exc)
