"""The replica side of the control plane: the leader's heartbeats (with pushed membership) and quorum requests.

Liveness has two levels. A group's leader (shard rank 0) heartbeats on one persistent connection: the lighthouse
declares the group dead the moment that connection closes (a crash) or falls silent past the heartbeat timeout (a
hang), and answers the heartbeat long-polls of everyone else at once, so survivors learn of a death without waiting
for a collective timeout. The group's other ranks beat to their leader (``membership.relay``), which reports
one lost at once and relays every answer to them. Only the leader asks for quorums, on the same connection as its
heartbeats, where each request is answered as soon as it is ready (``connection.LighthouseConnection``): one persistent
lighthouse connection per group. A checkpoint's report, rare, uses a short connection of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from lightning_fthsdp.config.timeouts import ANSWER_SLACK_MS, Timeouts
from lightning_fthsdp.membership.connection import LighthouseConnection, LighthouseRejected, LighthouseUnavailable
from lightning_fthsdp.membership.relay import GroupRelay
from lightning_fthsdp.membership.view import Membership, MembershipView
from lightning_fthsdp.protocol.answers import quorum_news_body, read_probe_answer
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.protocol.requests import (
    CaughtUp,
    StepTiming,
    checkpoint_body,
    heartbeat_body,
    leave_body,
    lost_body,
    quorum_body,
    with_members,
)


class ProbeRequested(RuntimeError):
    """The lighthouse asks the group to probe ``targets`` (replica id -> address) and ask again with the ids it could
    not reach: its exchange failed while every member lived (``lighthouse.exclusions``)."""

    def __init__(self, targets: dict[str, str], why: str) -> None:
        super().__init__(f"the lighthouse asks for a probe of {len(targets)} groups: {why}")
        self.targets = targets


class Excluded(RuntimeError):
    """The lighthouse keeps this live group out of the quorum (it could not reach some members, or it is a straggler):
    no quorum this step. ``targets``: the peers to probe before asking again; it is admitted once it reaches them
    all (a straggler: none; it is admitted once its step times keep pace, see ``lighthouse.stragglers``)."""

    def __init__(self, detail: dict[str, Any], targets: dict[str, str]) -> None:
        until = (f"it is admitted once it reaches {','.join(sorted(targets))} again" if targets or
                 detail.get("reason") != "straggler" else "it is admitted again once its step time keeps pace")
        super().__init__(f"the lighthouse keeps this group out of the quorum ({detail.get('reason')}: "
                         f"{detail.get('detail')}); {until}")
        self.detail, self.targets = detail, targets


class Heartbeat(MembershipView):
    """The leader's heartbeat: a daemon thread that heartbeats as long-polls, reports who the lighthouse declared dead,
    and relays every answer to the group's other ranks (``relay``; None for a one-rank group).

    ``on_dead``, ``on_quorum``, ``on_lost`` and the lease are ``membership.view.Membership``'s. ``deaths`` is
    how often the lighthouse has declared this group dead, as of the last acknowledged heartbeat. ``incarnation``:
    this start of the group's processes (the same on every rank; see lighthouse.registry). A rank the relay loses is
    reported at once (``POST /v1/lost``, answered at once beside a held heartbeat or quorum request), and every
    later heartbeat carries the ranks lost, so the lighthouse keeps the group dead while one is. ``connection``: the
    leader's one connection to the lighthouse, shared with its ``QuorumClient`` (None: one of its own).
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        replica_id: str,
        incarnation: str,
        rank: int,
        shard_count: int,
        timeouts: Timeouts,
        step: Callable[[], int],
        on_dead: Callable[[frozenset[str]], None],
        on_quorum: Callable[[int, int, int, str], None],
        on_lost: Callable[[str], None],
        relay: GroupRelay | None = None,
        connection: LighthouseConnection | None = None,
    ) -> None:
        self._conn = connection or LighthouseConnection(url, token)
        self._shard_count = shard_count
        self._replica_id, self._incarnation, self._rank = replica_id, incarnation, rank
        self._timeouts = timeouts
        self._step = step
        self._relay = relay
        self.membership = Membership(replica_id, timeouts, on_dead, on_quorum, on_lost)
        self._stop = threading.Event()
        self._started = False
        self._thread = threading.Thread(target=self._run, name=f"fthsdp-heartbeat-{replica_id}-{rank}", daemon=True)

    def start(self) -> None:
        if self._relay is not None:
            self._relay.start(self._report_lost)
        self._thread.start()
        self._started = True

    def _run(self) -> None:
        interval_s = self._timeouts.heartbeat_interval_ms / 1000
        timeout_s = self._timeouts.heartbeat_timeout_ms / 1000
        while not self._stop.is_set():
            sent = time.monotonic()
            relay = self._relay
            lost, losses = (relay.lost, relay.losses) if relay is not None else (None, 0)
            body = heartbeat_body(self._replica_id, self._incarnation, self._rank, self._step(), self._shard_count,
                                  self.membership.epoch, self._timeouts.heartbeat_interval_ms, lost, losses)
            try:
                answer = self._conn.post("/v1/heartbeat", body, timeout_s=interval_s + timeout_s)
            except LighthouseUnavailable as exc:
                if self._relay is not None:
                    self._relay.publish({"unavailable": {"refused": exc.refused, "timed_out": exc.timed_out}})
                if not self.membership.unavailable(exc.refused, exc.timed_out):
                    self._stop.wait(interval_s)
                continue
            except LighthouseRejected:
                # A request the lighthouse refuses (e.g. wrong token) never becomes valid by retrying fast.
                self._stop.wait(interval_s)
                continue
            self.membership.answered(answer, sent)
            if self._relay is not None:
                self._relay.publish({"answer": answer, "age_ms": round((time.monotonic() - sent) * 1000, 3)})

    def quorum_answered(self, quorum: Quorum, store: str) -> None:
        """The leader's quorum answer (``QuorumClient.request``), news to the group at once: the lighthouse wakes no
        held heartbeat for a new quorum, so this is how every rank starts the quorum's rendezvous as it is decided.
        Relayed only when new to the leader: the same quorum answered again each step is no message to the ranks (and
        one the leader had from a heartbeat answer reached them with that answer)."""
        news = quorum_news_body(quorum.quorum_id, quorum.rank_of(self._replica_id), len(quorum.members), store)
        if self.membership.quorum(news) and self._relay is not None:
            self._relay.publish({"quorum": news}, channel="quorum")

    def _report_lost(self, rank: int, cause: str, reason: str) -> None:
        """The relay lost ``rank`` (``crash`` or ``hang``): tell the lighthouse now rather than with the next
        heartbeat (up to an interval away)."""
        assert self._relay is not None, "only a relay loses ranks"
        body = lost_body(self._replica_id, self._incarnation, self._rank, rank, cause, self._relay.losses)
        with contextlib.suppress(LighthouseUnavailable, LighthouseRejected):  # the next heartbeat carries it too
            self._conn.post("/v1/lost", body, timeout_s=self._timeouts.heartbeat_timeout_ms / 1000)

    def leave(self) -> None:
        """Stop heartbeating and tell the lighthouse this rank is finishing (rank 0: the whole group leaves)."""
        self._stop.set()
        if self._relay is not None:
            self._relay.close()
        # Outlasts a heartbeat in flight (held up to the interval, then answered within the timeout): the leave
        # below uses the same connection.
        in_flight_ms = self._timeouts.heartbeat_interval_ms + self._timeouts.heartbeat_timeout_ms
        if self.started:  # a rank that fails before its first step never started heartbeating
            self._thread.join(timeout=in_flight_ms / 1000 + 1)
        with contextlib.suppress(LighthouseUnavailable, LighthouseRejected):
            self._conn.post("/v1/leave", leave_body(self._replica_id, self._incarnation, self._rank),
                            timeout_s=self._timeouts.heartbeat_timeout_ms / 1000)
        self._conn.close()


class QuorumClient:
    """The leader's quorum requests, blocking (the manager runs them on a background thread), for the group
    incarnation ``incarnation``. ``connection``: the leader's one connection to the lighthouse, shared with its
    ``Heartbeat`` (None: one of its own), where it is answered when decided, ahead of the held heartbeat."""

    def __init__(self, url: str, token: str | None, timeouts: Timeouts, incarnation: str,
                 connection: LighthouseConnection | None = None) -> None:
        self._conn = connection or LighthouseConnection(url, token)
        self._shared = connection is not None
        self._timeouts = timeouts
        self._incarnation = incarnation
        self._closed = threading.Event()
        self._asking = threading.Lock()  # held while a request is in flight: close() shuts the connection only then

    def request(
        self,
        replica_id: str,
        step: int,
        shard_count: int,
        address: str,
        commit_failed: bool,
        current: Quorum | None,
        committed_in: int,
        following: bool,
        caught_up: CaughtUp | None = None,
        unreachable: list[str] | None = None,
        timing: StepTiming | None = None,
        exchange_failed: bool = False,
        rendezvous_failed: bool = False,
    ) -> tuple[Quorum, str]:
        """Return the next quorum and the rendezvous store address ``HOST:PORT``. ``caught_up``: the catch-up this
        group finished since its last request (``source``, ``step``, ``bytes``, ``fetch_s``), for the lighthouse's
        event log and metrics. ``exchange_failed``: the last step's cross-group collective failed (the lighthouse may
        then ask for a probe of the members); ``rendezvous_failed``: it could not even build the quorum's cross-group
        group (proof that no member committed that step). ``unreachable``: the groups a probe the lighthouse asked for
        could not reach (None: no probe was asked for). ``timing``: the times of this group's last step
        (``compute_s`` and, if it exchanged, ``wait_s``), for the lighthouse's straggler measurement.

        The request names ``current`` by its id and members digest; its members go only to a lighthouse that asks for
        them (428: it is new or restarted, or must tell its own quorum of that id from its predecessor's), in the same
        request sent again at once. The answer may be a delta against ``current``.

        Raises LighthouseUnavailable (unreachable), LighthouseRejected (an error answer, 504 on timeout),
        ProbeRequested (probe, then ask again), Excluded (no quorum for this group now), or ValueError for a delta
        answer that does not fit ``current`` (a protocol error: never a guessed membership).
        """
        timeout_ms = self._timeouts.quorum_timeout_ms
        body = quorum_body(replica_id, self._incarnation, step, shard_count, address, commit_failed, current,
                           committed_in, following, timeout_ms, caught_up=caught_up, unreachable=unreachable,
                           exchange_failed=exchange_failed, rendezvous_failed=rendezvous_failed, timing=timing)
        wait_s = (timeout_ms + ANSWER_SLACK_MS) / 1000
        with self._asking:
            try:
                answer = self._conn.post("/v1/quorum", body, timeout_s=wait_s, stop=self._closed)
            except LighthouseRejected as exc:
                if exc.status != HTTPStatus.PRECONDITION_REQUIRED or current is None:
                    raise
                answer = self._conn.post("/v1/quorum", with_members(body, current), timeout_s=wait_s,
                                         stop=self._closed)
        probe = read_probe_answer(answer)
        if probe is not None and probe.excluded is not None:
            raise Excluded(probe.excluded, probe.targets)
        if probe is not None:
            raise ProbeRequested(probe.targets, probe.why)
        return Quorum.from_json(answer, current), str(answer["store"])

    def close(self) -> None:
        """No more requests (from any thread). A request in flight fails now: the connection is shut under it. A
        shared connection is shut only then, and the heartbeat goes on on a fresh one (the lighthouse sees that close
        as the group's crash: close only a group that is going)."""
        self._closed.set()
        if not self._shared:
            self._conn.close()
        elif not self._asking.acquire(blocking=False):
            self._conn.reset()
        else:
            self._asking.release()


class CheckpointReporter:
    """The writing group leader's reports of complete durable checkpoints (``POST /v1/checkpoint``), for the group
    incarnation ``incarnation``: the lighthouse resumes from the newest when no live group holds the committed step.
    Each report goes on a short connection of its own, closed after it: reports are rare."""

    def __init__(self, url: str, token: str | None, timeouts: Timeouts, replica_id: str, incarnation: str) -> None:
        self._conn = LighthouseConnection(url, token)
        self._timeouts = timeouts
        self._replica_id, self._incarnation = replica_id, incarnation
        self._lock = threading.Lock()

    def report(self, step: int, path: str) -> None:
        """Raises LighthouseUnavailable (unreachable) or LighthouseRejected (e.g. 409: a step beyond the job's)."""
        with self._lock:  # one connection, reports from whichever writer thread finished
            try:
                self._conn.post("/v1/checkpoint", checkpoint_body(self._replica_id, self._incarnation, step, path),
                                timeout_s=(self._timeouts.heartbeat_timeout_ms + ANSWER_SLACK_MS) / 1000)
            finally:  # reports are rare: no connection of the group's but the leader's stays open between them
                self._conn.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
