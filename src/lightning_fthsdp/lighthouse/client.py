"""The replica side of the control plane: the leader's heartbeats (with pushed membership) and quorum requests.

Liveness has two levels. A group's leader (shard rank 0) heartbeats on one persistent connection: the lighthouse
declares the group dead the moment that connection closes (a crash) or falls silent past the heartbeat timeout (a
hang), and answers the heartbeat long-polls of everyone else at once, so survivors learn of a death without waiting
for a collective timeout. The group's other ranks beat to their leader (``lighthouse.group_relay``), which reports
one lost at once and relays every answer to them. Only the leader asks for quorums.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.group_relay import GroupRelay
from lightning_fthsdp.lighthouse.membership import Membership
from lightning_fthsdp.lighthouse.quorum import Quorum


class LighthouseUnavailable(ConnectionError):
    """The lighthouse could not be reached (refused, reset, timed out): its state is unknown.

    ``refused``: nothing listens at its address (the lighthouse process is gone), as opposed to a connection
    that broke or timed out (the lighthouse may be up and may have declared us dead). ``timed_out``: no answer in
    time (a slow or paused lighthouse, not necessarily a gone one).
    """

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.refused, self.timed_out = refused, timed_out


class LighthouseRejected(RuntimeError):
    """The lighthouse answered with an error status: the request itself is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"lighthouse answered {status}: {message}")
        self.status = status


class _Connection:
    """One keep-alive HTTP connection that reconnects on the next request after any error.

    A reused connection the lighthouse has closed in the meantime (it closes idle ones) fails with a reset or a
    broken pipe; the request is then sent once more on a fresh connection, as urllib3 does. Every request here is
    safe to repeat (a heartbeat, a quorum request that replaces the group's earlier one, a leave), and a lighthouse
    that is gone refuses the fresh connection, which is reported as before.
    """

    def __init__(self, url: str, token: str | None) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"lighthouse URL must look like http://HOST:PORT, got {url!r}")
        self._host, self._port = parsed.hostname, parsed.port
        # A full quorum answer is O(members) bytes: the lighthouse gzips it once for every member that accepts it.
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "gzip"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False
        self._lock = threading.Lock()  # abort() against a request that is connecting

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        data = json.dumps(body)
        for attempt in (1, 2):
            if self._aborted:
                raise LighthouseUnavailable(f"{path}: the connection was closed for good")
            reused = self._conn is not None and self._conn.sock is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
            try:
                if self._conn.sock is None:
                    self._conn.connect()
                with self._lock:  # an abort() that saw no socket yet is seen here; a later one shuts this one
                    aborted = self._aborted
                if not aborted:
                    self._conn.request("POST", path, body=data, headers=self._headers)
                    response = self._conn.getresponse()
                    payload = response.read()
                    break
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # RemoteDisconnected is a ConnectionResetError. A timeout is never retried: the request may be held.
                if reused and attempt == 1 and isinstance(exc, ConnectionResetError | BrokenPipeError):
                    continue
                raise LighthouseUnavailable(f"{path}: {exc}", refused=isinstance(exc, ConnectionRefusedError),
                                            timed_out=isinstance(exc, TimeoutError)) from exc
            self.close()  # aborted while it connected
            raise LighthouseUnavailable(f"{path}: the connection was closed for good")
        try:
            if response.getheader("Content-Encoding") == "gzip":
                payload = gzip.decompress(payload)
            answer = json.loads(payload or b"{}")
        except (ValueError, OSError, EOFError, zlib.error) as exc:
            self.close()
            raise LighthouseUnavailable(f"{path}: unreadable answer {payload[:200]!r}") from exc
        if response.status != 200:
            raise LighthouseRejected(response.status, str(answer.get("error", payload[:200])))
        return answer

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def abort(self) -> None:
        """Close for good, from any thread: a request blocked on the connection fails now (a plain close would not
        wake it), and no later one is sent."""
        with self._lock:
            self._aborted = True
            conn = self._conn
            sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Heartbeat:
    """The leader's heartbeat: a daemon thread that heartbeats as long-polls, reports who the lighthouse declared
    dead, and relays every answer to the group's other ranks (``relay``; None for a one-rank group).

    ``on_dead``, ``on_quorum``, ``on_lost`` and the lease are ``lighthouse.membership.Membership``'s. ``deaths`` is
    how often the lighthouse has declared this group dead, as of the last acknowledged heartbeat. ``incarnation``:
    this start of the group's processes (the same on every rank; see lighthouse.registry). A rank the relay loses
    is reported at once (``POST /v1/lost``, on a connection of its own: the heartbeat's may be held in a long-poll),
    and every later heartbeat carries the ranks lost, so the lighthouse keeps the group dead while one is.
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
        on_lost: Callable[[], None],
        relay: GroupRelay | None = None,
    ) -> None:
        self._conn = _Connection(url, token)
        self._report_conn = _Connection(url, token)
        self._report_lock = threading.Lock()
        self._shard_count = shard_count
        self._identity = {"replica_id": replica_id, "incarnation": incarnation, "rank": rank}
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

    @property
    def started(self) -> bool:
        return self._started

    @property
    def dead(self) -> frozenset[str]:
        return self.membership.dead

    @property
    def deaths(self) -> int:
        return self.membership.deaths

    @property
    def lease_ms(self) -> int:
        return self.membership.lease_ms

    def lease_valid(self, deaths_before: int) -> bool:
        """See ``Membership.lease_valid``."""
        return self.membership.lease_valid(deaths_before)

    def _run(self) -> None:
        interval_s = self._timeouts.heartbeat_interval_ms / 1000
        timeout_s = self._timeouts.heartbeat_timeout_ms / 1000
        while not self._stop.is_set():
            sent = time.monotonic()
            body = {
                **self._identity,
                "step": self._step(),
                "shard_count": self._shard_count,
                "known_epoch": self.membership.epoch,
                "wait_ms": self._timeouts.heartbeat_interval_ms,
            }
            if self._relay is not None:
                body["losses"], body["lost"] = self._relay.losses, self._relay.lost
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

    def _report_lost(self, rank: int, cause: str, reason: str) -> None:
        """The relay lost ``rank`` (``crash`` or ``hang``): tell the lighthouse now rather than with the next
        heartbeat (up to an interval away)."""
        assert self._relay is not None, "only a relay loses ranks"
        body = {**self._identity, "lost_rank": rank, "cause": cause, "losses": self._relay.losses}
        with self._report_lock, contextlib.suppress(LighthouseUnavailable, LighthouseRejected):
            self._report_conn.post("/v1/lost", body, timeout_s=self._timeouts.heartbeat_timeout_ms / 1000)

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
            self._conn.post("/v1/leave", self._identity, timeout_s=self._timeouts.heartbeat_timeout_ms / 1000)
        self._conn.close()
        with self._report_lock:
            self._report_conn.close()


class QuorumClient:
    """The leader's quorum requests, blocking (the manager runs them on a background thread), for the group
    incarnation ``incarnation``."""

    def __init__(self, url: str, token: str | None, timeouts: Timeouts, incarnation: str) -> None:
        self._conn = _Connection(url, token)
        self._timeouts = timeouts
        self._incarnation = incarnation

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
        caught_up: dict[str, object] | None = None,
    ) -> tuple[Quorum, str]:
        """Return the next quorum and the rendezvous store address ``HOST:PORT``. ``caught_up``: the catch-up this
        group finished since its last request (``source``, ``step``, ``bytes``, ``fetch_s``), for the lighthouse's
        event log and metrics.

        The request names ``current`` by its id and members digest; its members go only to a lighthouse that asks for
        them (428: it is new or restarted, or must tell its own quorum of that id from its predecessor's), in the same
        request sent again at once. The answer may be a delta against ``current``.

        Raises LighthouseUnavailable (unreachable), LighthouseRejected (an error answer, 504 on timeout), or
        ValueError for a delta answer that does not fit ``current`` (a protocol error: never a guessed membership).
        """
        timeout_ms = self._timeouts.quorum_timeout_ms
        body = quorum_request_body(replica_id, self._incarnation, step, shard_count, address, commit_failed, current,
                                   committed_in, following, timeout_ms)
        if caught_up is not None:
            body["caught_up"] = caught_up
        try:
            answer = self._conn.post("/v1/quorum", body, timeout_s=timeout_ms / 1000 + 5)
        except LighthouseRejected as exc:
            if exc.status != HTTPStatus.PRECONDITION_REQUIRED or current is None:
                raise
            answer = self._conn.post("/v1/quorum", with_members(body, current), timeout_s=timeout_ms / 1000 + 5)
        return Quorum.from_json(answer, current), str(answer["store"])

    def close(self) -> None:
        """End the connection for good, waking a request blocked on it (from any thread)."""
        self._conn.abort()


def quorum_request_body(replica_id: str, incarnation: str, step: int, shard_count: int, address: str,
                        commit_failed: bool, current: Quorum | None, committed_in: int, following: bool,
                        timeout_ms: int) -> dict[str, object]:
    """The body of a ``POST /v1/quorum`` (``lighthouse.api.parse_quorum``) without the members of ``current``, which
    go only where the lighthouse asks for them (``with_members``)."""
    return {
        "replica_id": replica_id,
        "incarnation": incarnation,
        "step": step,
        "shard_count": shard_count,
        "address": address,
        "commit_failed": commit_failed,
        "quorum_id": current.quorum_id if current else -1,
        "members_digest": current.members_digest if current else "",
        "committed_in": committed_in,
        "following": following,
        "timeout_ms": timeout_ms,
    }


def with_members(body: dict[str, object], current: Quorum) -> dict[str, object]:
    """``body`` sent again to a lighthouse that answered it 428: with the members of the quorum held."""
    return {**body, "members": list(current.member_ids)}


class CheckpointReporter:
    """The writing group leader's reports of complete durable checkpoints (``POST /v1/checkpoint``), for the group
    incarnation ``incarnation``: the lighthouse resumes from the newest when no live group holds the committed step."""

    def __init__(self, url: str, token: str | None, timeouts: Timeouts, replica_id: str, incarnation: str) -> None:
        self._conn = _Connection(url, token)
        self._timeouts = timeouts
        self._identity = {"replica_id": replica_id, "incarnation": incarnation}
        self._lock = threading.Lock()

    def report(self, step: int, path: str) -> None:
        """Raises LighthouseUnavailable (unreachable) or LighthouseRejected (e.g. 409: a step beyond the job's)."""
        with self._lock:  # one connection, reports from whichever writer thread finished
            self._conn.post("/v1/checkpoint", {**self._identity, "step": step, "path": path},
                            timeout_s=self._timeouts.heartbeat_timeout_ms / 1000 + 5)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
