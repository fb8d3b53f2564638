"""What a group claims, checked before its request changes anything: the state it holds against what the job committed
(``ledger.CommitLedger``), its shard count against the job's (``api.check_shard_count``), and who may be a catch-up
source. Every refusal is an ``HttpError`` (409, or 428 when the check needs the members of the quorum the group
holds and its request did not send them)."""

from __future__ import annotations

from collections.abc import Collection

from lightning_fthsdp.lighthouse.api import QuorumAnswers, check_shard_count
from lightning_fthsdp.lighthouse.ledger import CommitLedger, MembersNeeded
from lightning_fthsdp.lighthouse.messages import HttpError
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest


class Claims:
    """The checks of a lighthouse's requests, over its registry, ledger and pending requests. ``shard_count``: the
    job's (None: the live groups', see ``api.check_shard_count``)."""

    def __init__(self, registry: Registry, ledger: CommitLedger, readiness: Readiness, shard_count: int | None) -> None:
        self._registry, self._ledger, self._readiness = registry, ledger, readiness
        self._shard_count = shard_count

    def check_heartbeat(self, replica_id: str, incarnation: str, step: int, now: float) -> None:
        """Refuse (409) a heartbeat claiming a state this job never committed."""
        self._check(replica_id, incarnation, step, None, now)

    def check_request(self, asked: QuorumRequest, incarnation: str, now: float, previous: Quorum | None,
                      answers: QuorumAnswers) -> None:
        """Refuse a quorum request claiming a state this job never committed (409), or one that must send the members
        of the quorum it holds first (428)."""
        try:
            self._check(asked.replica_id, incarnation, asked.step, asked.committed_in, now,
                        (asked.quorum_id, self._held_members(asked, previous, answers)))
        except MembersNeeded as e:
            raise members_needed(asked, str(e)) from None

    def check_shard_count(self, replica_id: str, shard_count: int, previous: Quorum | None) -> None:
        """Refuse (409) a group whose shard count is not the job's."""
        def lives(rid: str) -> bool:
            record = self._registry.get(rid)
            return record is not None and not record.dead

        check_shard_count(replica_id, shard_count, self._shard_count, previous, self._readiness.pending, lives)

    def seen_committed(self) -> frozenset[str]:
        """The requesters whose incarnation this lighthouse answered the quorum they claim to have committed in (or a
        later one): the only catch-up sources ``decide`` assigns while one of them is up to date."""
        seen = []
        for replica_id, request in self._readiness.pending.items():
            record = self._registry.get(replica_id)
            if record is not None and 0 <= request.committed_in <= record.answered:
                seen.append(replica_id)
        return frozenset(seen)

    def discarded(self, asked: QuorumRequest) -> dict[str, HttpError]:
        """A group reports that its commit failed because it could not build its quorum's cross-group group (not
        only a collective or its lease: another member may have completed a collective this one saw fail, and
        committed), in the quorum it was answered, at that quorum's last step: no member can have committed that step,
        so the ledger learns that the quorum committed nothing more. Returns the held requests claiming a commit there,
        each with its refusal (a claim that arrived first must not become the others' catch-up source)."""
        record = self._registry.get(asked.replica_id)
        if not asked.rendezvous_failed or record is None or record.answered != asked.quorum_id or \
                self._ledger.note_discard(asked.quorum_id, asked.step) is None:
            return {}
        refused = {}
        for rid, request in self._readiness.pending.items():
            try:
                self._ledger.check_discarded(rid, request.step, request.committed_in)
            except HttpError as e:
                refused[rid] = e
        return refused

    def _check(self, replica_id: str, incarnation: str, step: int, committed_in: int | None, now: float,
               held: tuple[int, Collection[str] | None] = (-1, ())) -> None:
        """MembersNeeded when the check takes the members of the quorum held and ``held`` has none."""
        record = self._registry.get(replica_id)
        own = record if record is not None and record.incarnation == incarnation else None
        lost_contact_in = own.answered if own is not None and own.lost_contact else -1
        self._ledger.check_claim(replica_id, step, committed_in, lost_contact_in, now, held,
                                 own.answered if own is not None else -1)

    @staticmethod
    def _held_members(asked: QuorumRequest, previous: Quorum | None,
                      answers: QuorumAnswers) -> Collection[str] | None:
        """The members of the quorum ``asked`` holds (None: not known). A request sends them only when the lighthouse
        asks for them (428), so they come from the member list this lighthouse answered under the request's members
        digest where it can. A lighthouse without a previous quorum (fresh or restarted) asks for them at once: it
        continues the quorum the groups hold (``quorum.adopt``, ``quorum.reference``)."""
        if asked.members or asked.quorum_id < 0:
            return asked.members
        if previous is None:
            raise members_needed(asked, "this lighthouse holds no quorum yet (it is new, or was restarted) and "
                                        "continues the one the groups hold")
        base = answers.base(asked.members_digest)
        return base.member_set if base is not None else None


def members_needed(asked: QuorumRequest, why: str) -> HttpError:
    """428 for a quorum request that holds a quorum and sent no members where the lighthouse needs them."""
    return HttpError(428, f"the quorum request of {asked.replica_id!r} holds quorum {asked.quorum_id} but sent no "
                          f"'members': {why}; resend it with the members of the quorum it holds")
