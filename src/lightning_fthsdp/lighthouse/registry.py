"""Who the lighthouse lets speak for a replica group: the job's declared ids and each group's live incarnation.

A replica id alone names a group, not a process: a stale process, a second process started with the same id by
mistake, or a forged client could otherwise leave, heartbeat or ask for quorums in a live group's name (and have it
declared dead or superseded). Each incarnation of a group (one start of its processes) picks a random incarnation id
(its form: ``protocol.fields.check_incarnation``) that every rank sends with every request; the lighthouse binds the
group to the first incarnation it hears from and admits a new one only once the old one is dead (its heartbeat
connection closed or its heartbeats expired).

Synchronous and clock-free (``now`` is an argument), like the quorum rules, so it is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus

from lightning_fthsdp.lighthouse.messages import HttpError


@dataclass
class GroupRecord:
    """What the lighthouse knows of one replica group."""

    incarnation: str
    step: int
    last_seen: float
    joined_s: float
    """When this incarnation first spoke."""
    dead: bool = False
    dead_since: float = 0.0
    cause: str = ""
    """How the last death was detected: ``crash`` (its heartbeat connection closed) or ``hang`` (no heartbeat within
    the timeout); "" while it never died."""
    incarnations: int = 1
    """Incarnations of this replica id so far (1: its first start), shown instead of the secret incarnation id."""
    deaths: int = 0
    """Times declared dead: a group compares it across a step so it never commits a step it was declared dead in."""
    member: bool = False
    """Whether the group was ever a member of a quorum: one that never was is forgotten a while after it died."""
    answered: int = -1
    """The newest quorum this incarnation was answered (-1: none)."""
    deaths_answered: int = 0
    """``deaths`` when it was answered that quorum."""
    lost: tuple[int, ...] = ()
    """The ranks its leader reports lost now: the group stays dead while any is (nothing it says revives it)."""
    losses: int = 0
    """Ranks its leader reported lost so far (this incarnation)."""
    address: str = ""
    """Where its leader serves state (from its latest quorum request): the target when another group probes it."""

    @property
    def lost_contact(self) -> bool:
        """Whether the lighthouse declared this incarnation dead since it answered it its newest quorum: it may have
        kept that quorum and trained on without the lighthouse."""
        return self.answered >= 0 and self.deaths > self.deaths_answered


class Registry:
    """The replica groups the lighthouse knows, keyed by replica id.

    ``declared``: the job's replica ids (None: any valid id may join, as with a lighthouse started by hand). With a
    declaration, an undeclared id is refused at the door; without one, an id that only heartbeats counts towards the
    quorum's majority (and is waited for) for its first ``grace_s`` only: a group asks for its first quorum as it
    starts heartbeating, so ids that merely heartbeat cannot stall the job for longer.
    """

    def __init__(self, declared: frozenset[str] | None = None, grace_s: float = 0.0) -> None:
        self.declared = declared
        self.grace_s = grace_s
        self._records: dict[str, GroupRecord] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def get(self, replica_id: str) -> GroupRecord | None:
        return self._records.get(replica_id)

    def items(self) -> ItemsView[str, GroupRecord]:
        return self._records.items()

    def check(self, replica_id: str, incarnation: str, rank: int) -> None:
        """Raise HttpError unless ``incarnation`` (rank ``rank`` of it) may speak for the group ``replica_id``: an
        undeclared id (403), a rank other than the leader of an incarnation the lighthouse does not know (404: the
        leader joins first), a new incarnation while the old one lives (503). Changes nothing."""
        if self.declared is not None and replica_id not in self.declared:
            raise HttpError(403, f"replica {replica_id!r} is not one of the job's replica ids "
                                 f"({', '.join(sorted(self.declared))}): start the group with one of them, or restart "
                                 f"the lighthouse with --replica-ids including it")
        record = self._records.get(replica_id)
        if record is not None and record.incarnation == incarnation:
            return
        if rank > 0:
            raise HttpError(404, f"replica {replica_id!r} has no incarnation {incarnation!r} here: its rank 0 must "
                                 f"heartbeat or ask for a quorum first")
        if record is not None and not record.dead:
            # 503: the client retries (the normal answer to a restart quicker than the heartbeat timeout) and gives
            # up with this message after its connect timeout.
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"replica {replica_id!r} is held by another live incarnation: a new one is admitted once "
                            f"the old one's heartbeat connection closes or its heartbeats stop for the heartbeat "
                            f"timeout; if two processes were started as {replica_id!r}, give one another id")

    def admit(self, replica_id: str, incarnation: str, now: float) -> tuple[GroupRecord, bool]:
        """The record of the group ``replica_id`` speaking as ``incarnation``, which ``check`` allowed, and whether
        that incarnation is new (the group's previous one, if any, is dead and replaced)."""
        record = self._records.get(replica_id)
        if record is not None and record.incarnation == incarnation:
            return record, False
        if record is None:
            record = self._records[replica_id] = GroupRecord(incarnation, 0, now, now)
            return record, True
        record.incarnation, record.step, record.answered = incarnation, 0, -1
        record.lost, record.losses = (), 0
        record.incarnations += 1
        record.last_seen = record.joined_s = now
        return record, True

    def owner(self, replica_id: str, incarnation: str) -> GroupRecord:
        """The record of ``replica_id`` if ``incarnation`` is its current one; HttpError 404 (unknown) or 409."""
        record = self._records.get(replica_id)
        if record is None:
            raise HttpError(404, f"replica {replica_id!r} is not known to this lighthouse")
        if record.incarnation != incarnation:
            raise HttpError(409, f"replica {replica_id!r} is held by another incarnation than {incarnation!r}: only "
                                 f"the process that joined may speak for it")
        return record

    def counts(self, replica_id: str, pending: bool, now: float, committed_step: int) -> bool:
        """Whether the group counts towards the majority of a quorum now (it must also be alive). An id that only
        heartbeats counts in its grace only while it holds ``committed_step``: one behind (a restarting group
        heartbeats while it builds) holds nothing the others lack, so they neither wait for it nor need it for
        their majority; it joins the next round and catches up."""
        record = self._records.get(replica_id)
        if record is None or record.dead:
            return False
        return self.declared is not None or pending or record.member or (
            now - record.joined_s < self.grace_s and record.step >= committed_step)

    def past_grace(self, now: float, committed_step: int) -> list[str]:
        """The live groups that only heartbeat and stopped counting since their grace ended or the job moved past
        their step (see ``counts``)."""
        if self.declared is not None:
            return []  # every live declared group counts
        # A member always counts (see counts): asked of every group a few times per heartbeat timeout, so it is
        # checked before the call.
        return [rid for rid, r in self._records.items()
                if not r.dead and not r.member and not self.counts(rid, False, now, committed_step)]

    def highest_step(self, replica_ids: Iterable[str]) -> int:
        """The highest step the groups ``replica_ids`` last said they hold (-1: none of them is known)."""
        return max((record.step for rid in replica_ids if (record := self._records.get(rid)) is not None), default=-1)

    def answered(self, replica_id: str, quorum_id: int) -> None:
        """The group's current incarnation was answered quorum ``quorum_id``: it is a member."""
        record = self._records.get(replica_id)
        if record is not None:
            record.member, record.answered, record.deaths_answered = True, quorum_id, record.deaths

    def addressed(self, replica_id: str, addresses: str) -> None:
        """The group's latest quorum request names its ranks' state addresses (comma separated, leader first)."""
        record = self._records.get(replica_id)
        if record is not None:
            record.address = addresses.split(",", 1)[0]

    def remove(self, replica_id: str) -> None:
        self._records.pop(replica_id, None)

    def forget_strays(self, dead_before: float) -> list[str]:
        """Forget the groups that died before ``dead_before`` without ever being a quorum member (stray or junk ids:
        they would pile up in ``/status`` and in every heartbeat answer); returns their ids."""
        strays = [rid for rid, r in self._records.items() if r.dead and not r.member and r.dead_since < dead_before]
        for replica_id in strays:
            del self._records[replica_id]
        return strays
