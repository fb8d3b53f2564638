"""What the job committed, as this lighthouse answered it: the claims of a group are checked against it.

A quorum request says which state the group holds: ``step`` (committed steps) and ``committed_in`` (the quorum of
its latest commit). A group that committed in quorum q trained from a step q was answered with, so it holds one of
``first(q) + 1 .. last(q) + 1``. A claim outside what the lighthouse answered is a state the job never committed (a
wrong checkpoint, a bug, a forgery): believing it would make that state every group's catch-up source, or make the
lighthouse think the job is further than it is and later report steps as lost.

The record is soft, like the rest of the lighthouse's state: a lighthouse may have been restarted, and then knows
nothing of the quorums before it, while the groups holding the job's state come back to it over the next seconds.
So until ``settles_at`` it believes a claim of a commit by a group whose quorum it did not form (one of the
lighthouse before it: quorum ids start again with each lighthouse, so a group's quorum is told apart by its members
too); a claim of no commit at all (a fresh process, or one that loaded a checkpoint) is always held to the committed
step. Before it has formed a quorum it has nothing to check against.

A claim is also held to who committed: only an incarnation this lighthouse answered a quorum commits in it (a new
incarnation has committed nothing since its process started), and a quorum one of whose members reported that it
could not build the quorum's cross-group process group for the step after the quorum's last one committed nothing
more (``note_discard``): a forger that joins a quorum and never joins its process group cannot then claim the step
the others discarded.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from lightning_fthsdp.lighthouse.messages import HttpError
from lightning_fthsdp.protocol.quorum import Quorum

log = logging.getLogger("fthsdp.lighthouse")

MAX_QUORUMS = 4096
"""Quorums whose step ranges the ledger keeps (a claim naming an older one is held to the step bound only)."""


class MembersNeeded(Exception):
    """``CommitLedger.check_claim`` needs the members of the quorum the claimer holds, which it was not given."""


def _refuse(replica_id: str, reason: str) -> HttpError:
    """409 for what ``replica_id`` claims (``reason``: "claims ..." or "reports ..."), logged: a refusal is news."""
    log.warning("refused replica %s: it %s", replica_id, reason)
    return HttpError(409, f"replica {replica_id!r} {reason}")


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
    """Each quorum this lighthouse answered, with the range of steps it was answered at.

    ``settles_at``: when (lighthouse clock) it stops believing commits in quorums it did not form.
    """

    settles_at: float = 0.0
    committed_step: int = -1
    """The highest step the job's quorum was answered at (-1: none yet): every member of it held that many steps.
    After a loss it is the step the job restarted from."""
    lost: list[LostState] = field(default_factory=list)
    checkpoint: DurableCheckpoint | None = None
    """The newest complete durable checkpoint (None: none reported to this lighthouse)."""
    _steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    _members: dict[int, int] = field(default_factory=dict)
    """Quorum id -> a hash of its member ids: which quorum a group holds, beyond the id."""
    _adopted: set[int] = field(default_factory=set)
    """Quorums first answered as adopted (``quorum.adopt``): formed by a lighthouse before this one, so members it
    has not answered yet may hold them."""
    _discarded: dict[int, int] = field(default_factory=dict)
    """Quorum id -> the step a member of it discarded (its last step + 1): the quorum committed nothing from it on."""
    _newest: int = -1

    def record(self, quorum: Quorum, adopted: bool = False) -> None:
        """``quorum`` was answered (``adopted``: as the quorum the groups hold, see ``quorum.adopt``)."""
        if adopted and quorum.quorum_id not in self._steps:
            self._adopted.add(quorum.quorum_id)
        first, last = self._steps.get(quorum.quorum_id, (quorum.max_step, quorum.max_step))
        self._steps[quorum.quorum_id] = (min(first, quorum.max_step), max(last, quorum.max_step))
        if quorum.quorum_id not in self._members:  # a quorum id names one member set: hash it once, not every step
            self._members[quorum.quorum_id] = hash(frozenset(quorum.member_ids))
        self.committed_step = max(self.committed_step, quorum.max_step)
        self._newest = max(self._newest, quorum.quorum_id)
        if len(self._steps) > MAX_QUORUMS:
            oldest = min(self._steps)
            del self._steps[oldest], self._members[oldest]
            self._discarded.pop(oldest, None)
            self._adopted.discard(oldest)

    def note_discard(self, quorum_id: int, step: int) -> int | None:
        """A member of the newest quorum ``quorum_id``, answered it at its last step ``step``, reports that it could
        not build the quorum's cross-group group for ``step + 1``. A collective of the quorum needs every member, so
        none of them committed that step:
        returns it when this is news (None: known already, not the newest quorum, or not its last step). A report
        that comes once the job has moved on (a member stopped and resumed) is no news of the others' commits."""
        steps = self._steps.get(quorum_id)
        if quorum_id != self._newest or steps is None or steps[1] != step or quorum_id in self._discarded:
            return None
        self._discarded[quorum_id] = step + 1
        return step + 1

    def note_lost(self, quorum: Quorum) -> LostState:
        """``quorum`` is answered below the committed step (after the bounded wait for a holder): the job goes on from
        its step, which becomes the committed step (the steps above it are gone; a state claiming them is refused)."""
        resumed = quorum.resume_step >= 0
        lost = LostState(quorum.quorum_id, quorum.max_step, self.committed_step,
                         quorum.resume_path if resumed else None)
        self.lost.append(lost)
        self.committed_step = quorum.max_step
        return lost

    def note_checkpoint(self, step: int, path: str, writer: str) -> None:
        """Record a complete checkpoint of ``step`` (one older than the one known is not kept); HttpError 409 when
        ``writer`` cannot hold it. A checkpoint holds a committed state: at most the committed step + 1 (its writer
        committed in the newest quorum)."""
        if self._newest >= 0 and step > self.committed_step + 1:
            raise _refuse(writer, f"reports a checkpoint of step {step}, beyond the job's committed step "
                                  f"{self.committed_step} + 1: that state was never committed by this job")
        if self.checkpoint is None or step >= self.checkpoint.step:
            self.checkpoint = DurableCheckpoint(step, path, writer)

    def resume_point(self, quorum: Quorum) -> DurableCheckpoint | None:
        """The checkpoint a quorum below the committed step resumes from: the newest, when it is ahead of what the
        quorum's members hold."""
        if self.checkpoint is not None and self.checkpoint.step > quorum.max_step:
            return self.checkpoint
        return None

    def check_claim(self, replica_id: str, step: int, committed_in: int | None, lost_contact_in: int, now: float,
                    held: tuple[int, Collection[str] | None] = (-1, ()), answered_in: int = -1) -> None:
        """HttpError 409 for a claim of ``replica_id`` to hold ``step`` committed in quorum ``committed_in`` (None:
        not stated, as in a heartbeat) that is not consistent with what this lighthouse answered.

        ``lost_contact_in``: the quorum the claimer's incarnation was answered last, if the lighthouse has declared
        it dead since (-1 otherwise). Such a group kept that quorum while it could not reach the lighthouse and
        trained on: it may hold more steps than the lighthouse answered, committed in that quorum. ``held``: the
        id and members of the quorum the claimer holds (a quorum request says; -1: none; members None: not known,
        then MembersNeeded is raised where they decide). ``answered_in``: the newest quorum the claimer's incarnation
        was answered (-1: none): only the incarnations answered a quorum commit in it.
        """
        reason = self._refusal(step, committed_in, lost_contact_in, now, held, answered_in)
        if reason is not None:
            raise _refuse(replica_id, reason)

    def check_discarded(self, replica_id: str, step: int, committed_in: int | None) -> None:
        """HttpError 409 for a claim of ``replica_id`` to hold ``step`` committed in quorum ``committed_in`` (None:
        the newest, as a heartbeat's) that its members discarded."""
        reason = self._discard_refusal(step, committed_in)
        if reason is not None:
            raise _refuse(replica_id, reason)

    def _refusal(self, step: int, committed_in: int | None, lost_contact_in: int, now: float,
                 held: tuple[int, Collection[str] | None], answered_in: int) -> str | None:
        if self._newest < 0:
            return None
        if (now < self.settles_at and committed_in is not None and committed_in >= 0
                and (committed_in not in self._steps or self._foreign(held))):
            return None
        # Before the lost-contact exemption: a member that trained on without the lighthouse did so with the others,
        # and one of them discarded the step.
        reason = self._discard_refusal(step, committed_in)
        if reason is not None:
            return reason
        if lost_contact_in == self._newest and committed_in in (None, lost_contact_in):
            return None
        if step > self.committed_step + 1:
            return (f"claims step {step}, beyond the job's committed step {self.committed_step} + 1: that state was "
                    f"never committed by this job (a wrong checkpoint or a bug); restart the group without it so it "
                    f"catches up")
        if step == self.committed_step + 1 and committed_in is not None and committed_in != self._newest:
            where = "no quorum" if committed_in < 0 else f"quorum {committed_in}"
            return (f"claims step {step}, which only a commit in the newest quorum {self._newest} reaches, but "
                    f"committed in {where}")
        if committed_in is None or committed_in < 0:
            return None
        if committed_in > self._newest:
            return f"claims a commit in quorum {committed_in}, which was never formed (the newest is {self._newest})"
        steps = self._steps.get(committed_in)
        if steps is None:
            return None  # older than the ledger keeps, or from before a restart: behind the job, it will catch up
        first, last = steps
        # Only the members answered a quorum commit in it. An adopted one's holders that this lighthouse has not
        # answered yet trained on in it while it was away, as its member that asked first did: they are held to its
        # steps below, as any member is (one past its last answer at most).
        if answered_in < committed_in and committed_in not in self._adopted:
            return (f"claims a commit in quorum {committed_in} but was not answered quorum {committed_in} (a new "
                    f"incarnation, or one that never joined it): only its members committed there; restart the group "
                    f"so it catches up")
        # A quorum's first answer may be an adoption after a restart: its holders committed in it at ``first``.
        if not first <= step <= last + 1:
            return (f"claims step {step} committed in quorum {committed_in}, which committed steps {first}.."
                    f"{last + 1} only: that state was never committed by this job")
        return None

    def _discard_refusal(self, step: int, committed_in: int | None) -> str | None:
        in_quorum = self._newest if committed_in is None else committed_in
        discarded = self._discarded.get(in_quorum)
        if discarded is None or step < discarded or (committed_in is None and step != discarded):
            return None
        return (f"claims step {step} committed in quorum {in_quorum}, whose members discarded step {discarded} (one "
                f"could not build the quorum's process group): that state was never committed by this job; restart "
                f"the group so it catches up")

    def _foreign(self, held: tuple[int, Collection[str] | None]) -> bool:
        """Whether the quorum a group holds is not the one this lighthouse formed under that id (a lighthouse before
        it formed it). Hashes its members: asked only while the lighthouse settles, never on the steady path. Raises
        MembersNeeded when that takes the members and ``held`` has none (None)."""
        held_id, held_members = held
        if held_id not in self._members:
            return held_id >= 0
        if held_members is None:
            raise MembersNeeded(f"this lighthouse formed a quorum {held_id} too, and has not settled (it started less "
                                f"than lost_state_wait_ms ago): only the members tell which of the two the group holds")
        # A frozenset is hashed as it is (it keeps its hash): the members of an answered base come as one, and
        # copying it would cost O(members) per request (compiled code does not return the same frozenset).
        members = held_members if isinstance(held_members, frozenset) else frozenset(held_members)
        return self._members[held_id] != hash(members)
