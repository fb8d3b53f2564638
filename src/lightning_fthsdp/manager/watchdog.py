"""A rank's liveness in two levels, and what a death does to the step under way.

The group's leader heartbeats to the lighthouse and relays its answers to the group's other ranks, which beat to the
leader (on its advertised address, where it also serves its state: a group's ranks may span hosts; one relay address,
agreed over the group's process group). When the lighthouse declares a member of the current quorum dead, the
exchange in flight is abandoned: this is what turns a hang into a stall of about the heartbeat timeout. When the
lighthouse goes away (for a rank other than the leader: the leader relaying it), so does the store hosting the
cross-group rendezvous, and a rendezvous under way on it is aborted.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.manager.agreement import GroupAgreement
from lightning_fthsdp.membership.client import Heartbeat
from lightning_fthsdp.membership.connection import LighthouseConnection
from lightning_fthsdp.membership.member import MemberHeartbeat
from lightning_fthsdp.membership.relay import GroupRelay
from lightning_fthsdp.protocol.quorum import Quorum


class Watchdog:
    """``heartbeat``: the leader's ``Heartbeat`` (to the lighthouse, on ``connection``) or a member's
    ``MemberHeartbeat`` (to its leader), made here; it starts with the first step (``FTManager.begin_step``)."""

    def __init__(self, agreement: GroupAgreement, comm: CrossGroupComm, url: str, token: str | None, host: str,
                 replica_id: str, incarnation: str, timeouts: Timeouts, step: Callable[[], int],
                 connection: LighthouseConnection | None) -> None:
        self._comm = comm
        self._quorum: Quorum | None = None
        self._deaths_at_quorum = 0
        rank, size = agreement.rank, agreement.size
        self._relay = GroupRelay(host, token, incarnation, timeouts) if agreement.is_leader and size > 1 else None
        relay = self._relay
        self.heartbeat: Heartbeat | MemberHeartbeat
        try:
            leader = agreement.from_leader(relay.address if relay is not None else "")
            if relay is not None:
                agreement.on_link_broken(relay.lose)  # a crashed rank is a death to report, not a graceful leave
            if agreement.is_leader:
                self.heartbeat = Heartbeat(url, token, replica_id, incarnation, rank, size, timeouts, step=step,
                                           on_dead=self._on_dead, on_quorum=comm.prepare,
                                           on_lost=self._lighthouse_lost, relay=relay, connection=connection)
            else:
                self.heartbeat = MemberHeartbeat(leader, token, replica_id, incarnation, rank, timeouts,
                                                 on_dead=self._on_dead, on_quorum=comm.prepare,
                                                 on_lost=self._lighthouse_lost)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Close what this watchdog opened (the leader's relay), for one whose heartbeat never started: its own or its
        owner's construction failed."""
        if self._relay is not None:
            self._relay.close()

    def adopted(self, quorum: Quorum) -> None:
        """``quorum`` is the current one: this group's lease holds from here while the lighthouse declares it dead no
        more (``lease_valid``)."""
        self._quorum = quorum
        self._deaths_at_quorum = self.heartbeat.deaths

    def abandon_if_dead(self) -> None:
        """Abandon the exchange of the current quorum if a member died before this rank got to it."""
        as_of = self.heartbeat.dead_as_of  # first: the heartbeat thread writes it after the dead set
        self._abandon_for(self.heartbeat.dead, as_of)

    def lease_valid(self) -> bool:
        """Whether the lighthouse acknowledged this group in time and declared it dead no more since the quorum."""
        return self.heartbeat.lease_valid(self._deaths_at_quorum)

    def _on_dead(self, dead: frozenset[str]) -> None:
        """The heartbeat thread's news of who is dead."""
        self._abandon_for(dead, self.heartbeat.dead_as_of)

    def _abandon_for(self, dead: frozenset[str], as_of: int) -> None:
        """Abandon the exchange of our quorum if ``dead`` (the lighthouse's answer when its newest quorum was
        ``as_of``) names a member: only a dead set as new as the quorum counts (``Membership.dead_as_of``)."""
        quorum = self._quorum
        if quorum is None or as_of < quorum.quorum_id:
            return
        gone = dead & set(quorum.member_ids)
        if gone:
            self._comm.abort(f"lighthouse declared {','.join(sorted(gone))} dead", quorum.quorum_id)

    def _lighthouse_lost(self, store_address: str) -> None:
        self._comm.abort_rendezvous("the lighthouse went away", store_address)
