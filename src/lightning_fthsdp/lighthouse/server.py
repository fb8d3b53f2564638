"""The lighthouse: the job's quorum service and rendezvous store host (control plane, CPU only).

State is soft: replicas (last heartbeat, step, dead or not), pending quorum requests and the previous quorum.
A restarted lighthouse rebuilds it from the groups' heartbeats and requests (``quorum.decide`` continues the
numbering from the requests' ``quorum_id``/``members``). Failure detection: a replica whose heartbeat
connection closes is declared dead at once (crash); one silent for ``heartbeat_timeout_ms`` is declared dead by
a timer (hang). Every epoch change (death, revival, leave, new quorum) answers all held heartbeat long-polls,
which is how survivors learn to abort an in-flight allreduce.

The HTTP API is summarised on :class:`Lighthouse`; every rejected request leaves the state as it was. The server
drives its parts: ``api`` (requests parsed and validated, the quorum answer encoded), ``readiness`` (whether a
decision would answer, kept per event), ``liveness`` (which connection's close declares which group dead) and
``quorum`` (the rules themselves).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lightning_fthsdp.lighthouse import page as lighthouse_page
from lightning_fthsdp.lighthouse.api import (
    authorize,
    check_shard_count,
    parse_heartbeat,
    parse_leave,
    parse_quorum,
    quorum_answer,
)
from lightning_fthsdp.lighthouse.http import (
    IDLE_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    Connection,
    HttpError,
    Request,
    Response,
    json_response,
)
from lightning_fthsdp.lighthouse.liveness import HeartbeatConnections
from lightning_fthsdp.lighthouse.quorum import Quorum, QuorumRequest, QuorumRules, adopt, decide, is_late_member
from lightning_fthsdp.lighthouse.readiness import Readiness

log = logging.getLogger("fthsdp.lighthouse")

MAX_LONG_POLL_MS = 5_000


@dataclass
class _Replica:
    step: int
    last_seen: float
    dead: bool = False
    deaths: int = 0
    """Times declared dead: a group compares it across a step so it never commits a step it was declared dead in."""


class Lighthouse:
    """Quorum service. ``start()`` binds the HTTP port and the TCPStore; ``stop()`` closes every connection.

    Both listen on ``host`` only. ``token``: when set, every request needs it in the ``Authorization`` header
    (Bearer, or Basic with the token as the password, for a browser), else 401; the groups also derive their
    rendezvous key prefixes on the store from it. ``request_timeout_s`` and ``idle_timeout_s`` bound slow and idle
    connections (see ``lighthouse.http``).

    Endpoints (JSON):
    ``POST /v1/heartbeat`` (long-poll on the epoch), ``POST /v1/quorum`` (held until a quorum containing the
    requester is decided, 504 after ``timeout_ms``), ``POST /v1/leave`` (graceful exit), ``GET /status``, ``GET /``.
    Bad input is answered 4xx with ``{"error": ...}`` naming the field, the value and the fix.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        store_port: int = 0,
        rules: QuorumRules | None = None,
        heartbeat_timeout_ms: int = 2_000,
        token: str | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        if not isinstance(heartbeat_timeout_ms, int) or heartbeat_timeout_ms <= 0:
            raise ValueError(f"Lighthouse heartbeat_timeout_ms must be an integer > 0, got {heartbeat_timeout_ms!r}")
        for name, value in (("request_timeout_s", request_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Lighthouse {name} must be a number of seconds > 0, got {value!r}")
        self._request_timeout_s, self._idle_timeout_s = float(request_timeout_s), float(idle_timeout_s)
        self.host, self.port, self.store_port = host, port, store_port
        self.rules = rules or QuorumRules()
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._token = token.encode() if token else None
        self._replicas: dict[str, _Replica] = {}
        # Alive groups and pending requests live in _readiness, which keeps decide() (O(n)) to the arrivals that
        # would form a quorum; the server changes them only through it.
        self._readiness = Readiness(self.rules)
        self._waiters: dict[str, asyncio.Future[Response]] = {}
        self._previous: Quorum | None = None
        self._answer: Response | None = None  # the encoded answer of _previous
        # The members _previous was answered to, alive since: only their ranks learn their quorum rank from heartbeats
        # (a new incarnation of a member must not take an answer meant for its predecessor).
        self._answered: set[str] = set()
        self._heartbeat_connections = HeartbeatConnections()
        self._epoch = 0
        self._epoch_changed = asyncio.Event()
        self._heartbeat_body: bytes | None = None
        self._decide_scheduled = False
        self._join_timer: asyncio.TimerHandle | None = None
        self._connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._store: Any = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._started_s = time.monotonic()
        self.store_address = ""
        self._routes: dict[str, tuple[str, Callable[[Request], Awaitable[Response]]]] = {
            "/v1/heartbeat": ("POST", self._heartbeat),
            "/v1/quorum": ("POST", self._quorum),
            "/v1/leave": ("POST", self._leave),
            "/status": ("GET", self._status),
            "/": ("GET", self._page),
        }

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind the HTTP server and the TCPStore on ``host``; ``port`` becomes the real one.

        An OSError (``socket.gaierror`` for a host that does not resolve) at once if ``host`` is not an address of
        this machine or a port is taken: both are bound here before anything waits on them.
        """
        from torch.distributed import TCPStore  # heavy import, only when a lighthouse actually runs

        # torch's TCPStore server listens on every interface of its port; handed a socket bound here, it listens on
        # that one only. Binding it ourselves also fails fast where torch would retry a bad host for minutes.
        store_socket = _listen_socket(self.host, self.store_port)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._connect, self.host, self.port, backlog=1024)
        except BaseException:
            store_socket.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        store_port = store_socket.getsockname()[1]
        try:
            # The store owns the descriptor from here on and closes it when it stops.
            self._store = TCPStore(self.host, store_port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=store_socket.detach())
        except BaseException:
            self._server.close()
            raise
        self.store_address = f"{self.host}:{store_port}"
        self._expiry_task = loop.create_task(self._expire_loop())
        self._started_s = time.monotonic()
        log.info("lighthouse on %s, store %s, %s, heartbeat timeout %d ms",
                 self.url, self.store_address, self.rules, self.heartbeat_timeout_ms)

    async def stop(self) -> None:
        """Close the server and every connection (held requests are dropped); declares nobody dead."""
        self._stopping = True
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        if self._join_timer is not None:
            self._join_timer.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self._store = None  # the TCPStore server stops when its last reference goes

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Run until ``stop`` is set (or forever, until cancelled); always stops cleanly."""
        await self.start()
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            await self.stop()

    # ---- HTTP plumbing ----

    def _connect(self) -> Connection:
        conn = Connection(self._route, self._connection_closed, self._request_timeout_s, self._idle_timeout_s)
        self._connections.add(conn)
        return conn

    def _connection_closed(self, conn: Connection) -> None:
        self._connections.discard(conn)
        key = self._heartbeat_connections.closed(conn)
        if key is not None and not self._stopping:
            self._declare_dead(key[0], f"the heartbeat connection of its rank {key[1]} closed")

    async def _route(self, request: Request) -> Response:
        authorize(request, self._token)
        if request.path not in self._routes:
            raise HttpError(404, f"unknown path {request.path!r}: use one of {', '.join(sorted(self._routes))}")
        method, handler = self._routes[request.path]
        if request.method != method:
            raise HttpError(405, f"{request.path} takes {method}, got {request.method}")
        return await handler(request)

    # ---- endpoints ----

    async def _heartbeat(self, request: Request) -> Response:
        beat = parse_heartbeat(request)
        replica_id = beat.replica_id
        check_shard_count(replica_id, beat.shard_count, self._previous, self._readiness.pending)
        if beat.rank > 0 and replica_id not in self._replicas:
            # Only a group's leader (re)creates it: a late heartbeat of a finishing rank after its leader left
            # must not bring the group back as a ghost the others would wait for.
            raise HttpError(404, f"replica {replica_id!r} is not known: its rank 0 must heartbeat first")
        self._touch(replica_id, beat.step)
        self._heartbeat_connections.bind((replica_id, beat.rank), request.connection)
        if self._epoch == beat.known_epoch and beat.wait_ms > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._epoch_changed.wait(), min(beat.wait_ms, MAX_LONG_POLL_MS) / 1000)
        if self._heartbeat_body is None:  # cached per epoch: a death wakes every long-poll at once
            self._heartbeat_body = json.dumps({
                "epoch": self._epoch,
                "quorum_id": self._previous.quorum_id if self._previous else -1,
                "quorum_size": len(self._previous.members) if self._previous else 0,
                "store": self.store_address,
                "dead": sorted(rid for rid, r in self._replicas.items() if r.dead),
                "deaths": {rid: r.deaths for rid, r in self._replicas.items() if r.deaths},
                "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            }).encode()
        if self._previous is not None and replica_id in self._answered:
            # Each member's rank in the newest quorum: with it every rank of the group starts that quorum's
            # cross-group rendezvous as soon as the quorum is decided, overlapping the step's compute.
            return Response(200, b'%s,"quorum_rank":%d}' % (self._heartbeat_body[:-1],
                                                            self._previous.rank_of(replica_id)))
        return Response(200, self._heartbeat_body)

    async def _quorum(self, request: Request) -> Response:
        asked, timeout_ms = parse_quorum(request, time.monotonic())
        replica_id = asked.replica_id
        check_shard_count(replica_id, asked.shard_count, self._previous, self._readiness.pending)
        self._touch(replica_id, asked.step)
        if self._answer is not None and is_late_member(self._previous, asked):
            self._answered.add(replica_id)
            return self._answer
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response] = loop.create_future()
        self._add_pending(asked, waiter)
        # A plain timer rather than asyncio.wait_for: fewer futures and callbacks per request when every group asks.
        timer = loop.call_later(timeout_ms / 1000, self._time_out, replica_id, timeout_ms, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if self._waiters.get(replica_id) is waiter:  # timed out or the client went away: forget the request
                self._drop_pending(replica_id)
                self._schedule_decide(force=True)

    def _time_out(self, replica_id: str, timeout_ms: int, waiter: asyncio.Future[Response]) -> None:
        if not waiter.done():
            waiter.set_exception(HttpError(
                504, f"no quorum containing {replica_id!r} within timeout_ms={timeout_ms}: {self._readiness.asked} "
                     f"of {len(self._readiness.alive)} alive replicas asked, min_replicas={self.rules.min_replicas}; "
                     f"raise timeout_ms or start more replica groups"))

    async def _leave(self, request: Request) -> Response:
        replica_id, rank = parse_leave(request)
        if replica_id not in self._replicas:
            raise HttpError(404, f"replica {replica_id!r} is not known to this lighthouse: nothing to leave")
        if rank > 0:
            # A non-leader rank finishing: only its heartbeat connection stops counting; the leader's leave (rank 0)
            # removes the group.
            self._heartbeat_connections.release((replica_id, rank))
            return json_response({})
        waiter = self._waiters.get(replica_id)
        self._set_alive(replica_id, False)
        self._drop_pending(replica_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(410, f"replica {replica_id!r} left while its quorum request was held"))
        del self._replicas[replica_id]
        self._heartbeat_connections.release_group(replica_id)
        log.info("replica %s left", replica_id)
        self._bump_epoch()
        self._schedule_decide(force=True)
        return json_response({})

    async def _status(self, request: Request) -> Response:
        return json_response(self.status())

    async def _page(self, request: Request) -> Response:
        return Response(200, lighthouse_page.render(self.status()).encode(), "text/html; charset=utf-8")

    def status(self) -> dict[str, object]:
        """The ``GET /status`` document. ``max_step`` is the highest step any known replica reported (-1: none)."""
        now, quorum = time.monotonic(), self._previous
        members = set(quorum.member_ids) if quorum else set()
        catch_up_from = quorum.catch_up_from if quorum else {}
        return {
            "quorum_id": quorum.quorum_id if quorum else -1,
            "epoch": self._epoch,
            "max_step": max((r.step for r in self._replicas.values()), default=-1),
            "min_replicas": self.rules.min_replicas,
            "members": list(quorum.member_ids) if quorum else [],
            "groups": [
                {"replica_id": rid, "step": r.step, "alive": rid in self._readiness.alive, "dead": r.dead,
                 "heartbeat_age_s": round(now - r.last_seen, 3), "in_quorum": rid in members,
                 "pending": rid in self._readiness.pending}
                for rid, r in sorted(self._replicas.items())
            ],
            "catch_up_from": [{"replica_id": k, "source": v} for k, v in sorted(catch_up_from.items())],
            "store": self.store_address,
            "uptime_s": round(now - self._started_s, 3),
        }

    # ---- state changes ----

    def _touch(self, replica_id: str, step: int) -> None:
        """A sign of life: record it; revive a dead replica (epoch change)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            self._replicas[replica_id] = _Replica(step, time.monotonic())
            self._set_alive(replica_id, True)
            return
        replica.step, replica.last_seen = step, time.monotonic()
        if replica.dead:
            replica.dead = False
            self._set_alive(replica_id, True)
            log.info("replica %s is alive again at step %d", replica_id, step)
            self._bump_epoch()

    def _declare_dead(self, replica_id: str, reason: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None or replica.dead:
            return
        replica.dead = True
        replica.deaths += 1
        self._set_alive(replica_id, False)
        log.warning("replica %s declared dead at step %d: %s", replica_id, replica.step, reason)
        self._bump_epoch()
        self._schedule_decide(force=True)

    def _set_alive(self, replica_id: str, alive: bool) -> None:
        if self._readiness.set_alive(replica_id, alive) and not alive:
            self._answered.discard(replica_id)

    def _add_pending(self, request: QuorumRequest, waiter: asyncio.Future[Response]) -> None:
        replica_id = request.replica_id
        old = self._waiters.get(replica_id)
        self._readiness.add(request)
        self._waiters[replica_id] = waiter
        if old is not None and not old.done():
            old.set_exception(HttpError(409, f"superseded by a newer quorum request from {replica_id!r}"))
        if self._join_timer is None:
            self._arm_join_timer()
        # Without a previous quorum (fresh or restarted) a healthy holder's request is adopted at once.
        self._schedule_decide(force=self._previous is None)

    def _drop_pending(self, replica_id: str) -> None:
        self._readiness.drop(replica_id)
        self._waiters.pop(replica_id, None)

    def _bump_epoch(self) -> None:
        self._epoch += 1
        self._heartbeat_body = None
        self._epoch_changed.set()  # wakes every held long-poll; later polls wait on a fresh event
        self._epoch_changed = asyncio.Event()

    # ---- deciding ----

    def _schedule_decide(self, force: bool = False) -> None:
        """Decide at most once per event-loop turn, and on an arrival only when the rules would answer."""
        if self._decide_scheduled or not (force or self._readiness.ready(time.monotonic())):
            return
        self._decide_scheduled = True
        asyncio.get_running_loop().call_soon(self._decide)

    def _decide(self) -> None:
        self._decide_scheduled = False
        if self._stopping:
            return
        receivers: frozenset[str] | None = None
        adopted = adopt(self._readiness.pending) if self._previous is None else None
        if adopted is not None:
            quorum, receivers = adopted
            log.info("adopting quorum %d (members %s) held by %s", quorum.quorum_id, ",".join(quorum.member_ids),
                     ",".join(sorted(receivers)))
        else:
            quorum = decide(self.rules, self._previous, self._readiness.pending, frozenset(self._readiness.alive),
                            time.monotonic())
        if quorum is not None:
            if self._previous is not None and quorum.max_step < self._previous.max_step:
                log.warning("quorum %d restarts from step %d although step %d was committed: no group holding that "
                            "state is left, so it is lost; resume every group from a durable checkpoint to keep it",
                            quorum.quorum_id, quorum.max_step, self._previous.max_step)
            changed = self._previous is None or self._previous.quorum_id != quorum.quorum_id
            self._previous = quorum
            self._readiness.formed(quorum)
            # A new membership is news; the same quorum answered again each step is not.
            log.log(logging.INFO if changed else logging.DEBUG, "quorum %d: members %s step %d%s", quorum.quorum_id,
                    ",".join(quorum.member_ids), quorum.max_step,
                    f" catch-up from {dict(quorum.catch_up_from)}" if quorum.catch_up_from else "")
            answer = self._answer = quorum_answer(quorum, self.store_address)
            self._answered = set(quorum.member_ids if receivers is None else receivers)
            for replica_id in self._answered:
                waiter = self._waiters.get(replica_id)
                self._drop_pending(replica_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)
            self._bump_epoch()
        self._arm_join_timer()

    def _arm_join_timer(self) -> None:
        """Wake at the oldest candidate's join deadline (never for a deadline already past: no busy loop)."""
        if self._join_timer is not None:
            self._join_timer.cancel()
            self._join_timer = None
        oldest = self._readiness.oldest()
        if oldest is not None and oldest + self.rules.join_timeout_s > time.monotonic():
            self._join_timer = asyncio.get_running_loop().call_at(oldest + self.rules.join_timeout_s,
                                                                  self._join_deadline)

    def _join_deadline(self) -> None:
        self._join_timer = None
        self._schedule_decide(force=True)

    async def _expire_loop(self) -> None:
        timeout_s = self.heartbeat_timeout_ms / 1000
        while True:
            await asyncio.sleep(timeout_s / 10)
            cutoff = time.monotonic() - timeout_s
            for replica_id in [rid for rid in self._readiness.alive if self._replicas[rid].last_seen < cutoff]:
                self._declare_dead(replica_id, f"no heartbeat for over {self.heartbeat_timeout_ms} ms")



def _listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s first address (IPv4 or IPv6) and ``port`` (0: a free one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)
