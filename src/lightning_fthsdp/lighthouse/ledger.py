"""What the job committed, as this lighthouse answered it: the claims of a group are checked against it.

A quorum request says which state the group holds: ``step`` (committed steps) and ``committed_in`` (the quorum of
its latest commit). A group that committed in quorum q trained from a step q was answered with, so it holds one of
``first(q) + 1 .. last(q) + 1``. A claim outside what the lighthouse answered is a state the job never committed (a
wrong checkpoint, a bug, a forgery): believing it would make that state every group's catch-up source, or make the
lighthouse think the job is further than it is and later report steps as lost.

The record is soft, like the rest of the lighthouse's state: a restarted lighthouse knows nothing of the quorums
before it and accepts the claims it cannot check (the first quorum it forms is adopted from what the groups hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_fthsdp.lighthouse.quorum import Quorum


@dataclass
class LostState:
    """A quorum that restarted below the job's committed step: no group holding that state was left. It resumed from
    the newest durable checkpoint (``checkpoint``: its path) when one was newer than what the live groups held."""

    quorum_id: int
    from_step: int
    committed_step: int
    checkpoint: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"quorum_id": self.quorum_id, "from_step": self.from_step, "committed_step": self.committed_step,
                "lost_steps": self.committed_step - self.from_step,
                "resumed_from": "checkpoint" if self.checkpoint is not None else "live groups",
                "checkpoint": self.checkpoint}


@dataclass(frozen=True)
class DurableCheckpoint:
    """The newest complete checkpoint a writing group reported."""

    step: int
    path: str
    writer: str

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "path": self.path, "writer": self.writer}


@dataclass
class CommitLedger:
    """Each quorum this lighthouse answered, with the range of steps it was answered at."""

    committed_step: int = -1
    """The highest step any quorum was answered at (-1: none yet): every member of it held that many steps."""
    lost: list[LostState] = field(default_factory=list)
    checkpoint: DurableCheckpoint | None = None
    """The newest complete durable checkpoint (None: none reported to this lighthouse)."""
    _steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    _first_id: int | None = None

    def record(self, quorum: Quorum) -> None:
        """``quorum`` was answered."""
        first, last = self._steps.get(quorum.quorum_id, (quorum.max_step, quorum.max_step))
        self._steps[quorum.quorum_id] = (min(first, quorum.max_step), max(last, quorum.max_step))
        self.committed_step = max(self.committed_step, quorum.max_step)
        if self._first_id is None:
            self._first_id = quorum.quorum_id

    def note_lost(self, quorum: Quorum) -> LostState:
        """``quorum`` is answered below the committed step (after the bounded wait for a holder): the job goes on from
        its step, which becomes the committed step (the steps above it are gone; a state claiming them is refused)."""
        resumed = quorum.resume_step >= 0
        lost = LostState(quorum.quorum_id, quorum.max_step, self.committed_step,
                         quorum.resume_path if resumed else None)
        self.lost.append(lost)
        self.committed_step = quorum.max_step
        return lost

    def note_checkpoint(self, step: int, path: str, writer: str) -> str | None:
        """Record a complete checkpoint of ``step``; returns why it is refused (None: recorded, or older than the one
        known, which is kept). A checkpoint holds a committed state: at most the committed step + 1 (its writer
        committed in the newest quorum)."""
        if self._first_id is not None and step > self.committed_step + 1:
            return (f"reports a checkpoint of step {step}, beyond the job's committed step {self.committed_step} + 1: "
                    f"that state was never committed by this job")
        if self.checkpoint is None or step >= self.checkpoint.step:
            self.checkpoint = DurableCheckpoint(step, path, writer)
        return None

    def resume_point(self, quorum: Quorum) -> DurableCheckpoint | None:
        """The checkpoint a quorum below the committed step resumes from: the newest, when it is ahead of what the
        quorum's members hold."""
        if self.checkpoint is not None and self.checkpoint.step > quorum.max_step:
            return self.checkpoint
        return None

    def refusal(self, step: int, committed_in: int | None, holds: int) -> str | None:
        """Why a claim to hold ``step`` committed in quorum ``committed_in`` (None: not stated, as in a heartbeat)
        is refused, or None when it is consistent with what this lighthouse answered. ``holds``: the newest quorum
        the claimer's incarnation was answered (-1: none).

        An incarnation answered the newest quorum that committed in it may be further than the lighthouse answered:
        it kept the quorum and trained on while the lighthouse was unreachable.
        """
        if self._first_id is None:
            return None
        kept = holds == max(self._steps) and committed_in in (None, holds)
        if step > self.committed_step + 1 and not kept:
            return (f"claims step {step}, beyond the job's committed step {self.committed_step} + 1: that state was "
                    f"never committed by this job (a wrong checkpoint or a bug); restart the group without it so it "
                    f"catches up")
        if committed_in is None or committed_in < 0:
            return None
        if committed_in < self._first_id:
            return None  # committed before this lighthouse started (it restarted since): nothing to check against
        steps = self._steps.get(committed_in)
        if steps is None:
            return (f"claims a commit in quorum {committed_in}, which was never formed (the newest is "
                    f"{max(self._steps)})")
        # The first quorum this lighthouse knows may be one it adopted after a restart: its holders committed in it
        # before it was answered here.
        first, last = steps
        low = first if committed_in == self._first_id else first + 1
        if not low <= step <= last + 1 and not kept:
            return (f"claims step {step} committed in quorum {committed_in}, which committed steps {low}..{last + 1} "
                    f"only: that state was never committed by this job")
        return None
