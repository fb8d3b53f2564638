"""A replica group's quorum, step by step: the leader asks the lighthouse for each step's in the background, reporting
the group's last step; the group's ranks agree on the answer and adopt it; and the group's liveness (``Watchdog``)
keeps it in the quorum: its lease fences the commit, and a member's death abandons the quorum's exchange."""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_fthsdp.config import log
from lightning_fthsdp.config.ranges import QUORUM, span
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.manager.agreement import GroupAgreement
from lightning_fthsdp.manager.request import QuorumRequester
from lightning_fthsdp.manager.watchdog import Watchdog
from lightning_fthsdp.membership.client import Heartbeat, QuorumClient
from lightning_fthsdp.membership.connection import LighthouseConnection
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.protocol.requests import CaughtUp, StepTiming
from lightning_fthsdp.recovery.catchup import CatchUp


class GroupQuorum:
    """One rank's side of its group's quorum. Every rank of the group constructs it at the same point: it agrees on
    the leader's relay address and on every rank's state-server address (``catchup``'s, which the leader's requests
    advertise) over the group's process group. Heartbeating starts with the first ``request``, not here: a group still
    building its model is not yet a heartbeating group the others must wait for or count in their majority."""

    def __init__(self, url: str, token: str | None, host: str, timeouts: Timeouts, agreement: GroupAgreement,
                 comm: CrossGroupComm, catchup: CatchUp, *, replica_id: str, incarnation: str,
                 step: Callable[[], int]) -> None:
        self._agreement, self._comm, self._catchup, self._step = agreement, comm, catchup, step
        self._replica_id = replica_id
        self._qlog = log.ReplicaLogger(log.QUORUM, replica_id, agreement.rank, step)
        self.quorum: Quorum | None = None
        """The quorum of the current (or last) step."""
        self.store_address = ""
        """Where the cross-group rendezvous of ``quorum`` meets."""
        self.commit_failed = False
        """The last commit failed for want of an exchange: the next request asks for fresh cross-group groups."""
        self._exchange_failed = False  # the last step's cross-group collective failed on a rank of this group
        self._rendezvous_failed = False  # ... before it began: the quorum's group was not built on a rank of this group
        self._timing: StepTiming | None = None  # the last step's times, until a request reports them
        self._catch_ups_reported = 0  # catch_up_log entries sent to the lighthouse (leader only)
        # The leader's one persistent connection to the lighthouse: its heartbeats and quorum requests, pipelined.
        lighthouse = LighthouseConnection(url, token) if agreement.is_leader else None
        self._watchdog = Watchdog(agreement, comm, url, token, host, replica_id, incarnation, timeouts, step,
                                  lighthouse)
        heartbeat = self._watchdog.heartbeat
        self._requester: QuorumRequester | None = None
        try:
            addresses = agreement.gather_addresses(catchup.address)
            if isinstance(heartbeat, Heartbeat):  # the leader's
                client = QuorumClient(url, token, timeouts, incarnation, lighthouse)
                self._requester = QuorumRequester(client, replica_id, agreement.size, addresses, timeouts,
                                                  self._qlog, step=step, serve=catchup.serve,
                                                  announce=heartbeat.quorum_answered)
        except BaseException:
            self._watchdog.discard()  # its relay listens already; nothing else here holds a socket yet
            raise

    @property
    def started(self) -> bool:
        """Whether the first step began (heartbeating did)."""
        return self._watchdog.heartbeat.started

    def request(self, step: int, committed_in: int, following: bool, catch_ups: list[dict[str, object]]) -> None:
        """Open ``step`` on the group's side: heartbeat from the first step on, and (leader) ask for its quorum in
        the background, unless a request is in flight (``QuorumRequester.start`` says what it reports). The newest
        of ``catch_ups`` (``Follower.catch_up_log``) and the last step's times (``lighthouse.stragglers``: who the
        others wait for) go to the lighthouse once, with the first request after them (its event log and metrics
        learn them only from us)."""
        if not self._watchdog.heartbeat.started:
            self._watchdog.heartbeat.start()
        if self._requester is None:
            return
        caught_up = None
        if len(catch_ups) > self._catch_ups_reported:
            entry = catch_ups[-1]
            caught_up = CaughtUp(entry["source"], entry["step"], entry["bytes"], entry["fetch_s"])  # type: ignore[arg-type]
        if self._requester.start(step, self.commit_failed, self.quorum, self.store_address, committed_in, following,
                                 caught_up, self._timing, exchange_failed=self._exchange_failed,
                                 rendezvous_failed=self._rendezvous_failed):
            self._catch_ups_reported, self._timing = len(catch_ups), None

    def voted(self, timing: StepTiming | None, *, exchange_failed: bool, rendezvous_failed: bool) -> None:
        """The group voted on its step: what the next request reports of it. ``timing``: its times (None: it has
        none, and an earlier step's still unreported go instead); ``exchange_failed``: its cross-group collective
        failed on a rank of the group (the lighthouse may ask the leader to probe the members); ``rendezvous_failed``:
        the quorum's cross-group group was not even built there."""
        self._timing = timing or self._timing
        self._exchange_failed, self._rendezvous_failed = exchange_failed, rendezvous_failed

    def agree(self) -> tuple[Quorum | None, float]:
        """The step's quorum: the leader's answer to the request in flight, the same on every rank
        (``GroupAgreement.quorum``), adopted (None: no quorum this step); and the seconds spent waiting for it."""
        asked = time.monotonic()
        with span(QUORUM):
            agreed = self._agreement.quorum(self._requester.answer if self._requester is not None else None)
        waited_s = time.monotonic() - asked
        return (self._adopt(*agreed) if agreed is not None else None), waited_s

    def lease_lost(self) -> str:
        """Why this group may not commit the step it began in the current quorum; "" when it may
        (``Watchdog.lease_valid``)."""
        if self._watchdog.lease_valid():
            return ""
        return (f"this group's lease ran out: no heartbeat acknowledged within the lighthouse's "
                f"heartbeat_timeout_ms={self._watchdog.heartbeat.lease_ms}, or it declared us dead")

    def closers(self) -> list[tuple[str, Callable[[], None]]]:
        """What ends the quorum requests and the heartbeat (leaving the job gracefully), in order, named for the
        log: the caller calls each on its own, so one that fails keeps none of the others from running."""
        closers: list[tuple[str, Callable[[], None]]] = [("the heartbeat", self._watchdog.heartbeat.leave)]
        if self._requester is not None:
            closers.insert(0, ("the quorum requests", self._requester.close))
        return closers

    def _adopt(self, quorum: Quorum, store_address: str) -> Quorum:
        """Make ``quorum`` the current one: serve the state if a catching-up group may fetch it from us, expect its
        collectives."""
        if self.quorum is None or quorum.quorum_id != self.quorum.quorum_id:
            self._qlog.info("quorum %d: members %s, max_step %d, participants %d", quorum.quorum_id,
                            ",".join(quorum.member_ids), quorum.max_step, len(quorum.participants),
                            extra={"quorum_id": quorum.quorum_id, "members": quorum.member_ids})
        self.quorum, self.store_address = quorum, store_address
        self._watchdog.adopted(quorum)
        if self._replica_id in quorum.serving:
            self._catchup.serve(self._step())
        elif not quorum.following:
            # While a member follows, its fetch may not even have reached us yet (a loaded host): keep the snapshot.
            self._catchup.stop_serving(unless_read=True)
        self._comm.expect(quorum.quorum_id)
        self._watchdog.abandon_if_dead()
        return quorum
