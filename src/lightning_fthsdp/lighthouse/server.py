"""The lighthouse: the job's quorum service and rendezvous store host (control plane, CPU only).

State is soft: replicas (last heartbeat, step, dead or not), pending quorum requests and the previous quorum.
A restarted lighthouse rebuilds it from the groups' heartbeats and requests (``quorum.decide`` continues the
numbering from the requests' ``quorum_id``/``members``). Failure detection: a replica whose heartbeat
connection closes is declared dead at once (crash); one silent for ``heartbeat_timeout_ms`` is declared dead by
a timer (hang). Every epoch change (death, revival, leave, new quorum) answers all held heartbeat long-polls,
which is how survivors learn to abort an in-flight allreduce.

The HTTP API is summarised on :class:`Lighthouse`; every rejected request leaves the state as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lightning_fthsdp.lighthouse import page as lighthouse_page
from lightning_fthsdp.lighthouse.http import (
    Connection,
    HttpError,
    Request,
    Response,
    json_response,
    require,
    require_int,
)
from lightning_fthsdp.lighthouse.quorum import (
    Quorum,
    QuorumRequest,
    QuorumRules,
    adopt,
    check_replica_id,
    decide,
    is_late_member,
    previous_from_requests,
)

log = logging.getLogger("fthsdp.lighthouse")

MAX_LONG_POLL_MS = 5_000
MAX_QUORUM_TIMEOUT_MS = 3_600_000
_NEVER = float("inf")


@dataclass
class _Replica:
    step: int
    last_seen: float
    dead: bool = False
    deaths: int = 0
    """Times declared dead: a group compares it across a step so it never commits a step it was declared dead in."""


class Lighthouse:
    """Quorum service. ``start()`` binds the HTTP port and the TCPStore; ``stop()`` closes every connection.

    Endpoints (JSON; ``Authorization: Bearer TOKEN`` or ``?token=`` when a token is set, else 401):
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
    ) -> None:
        if not isinstance(heartbeat_timeout_ms, int) or heartbeat_timeout_ms <= 0:
            raise ValueError(f"Lighthouse heartbeat_timeout_ms must be an integer > 0, got {heartbeat_timeout_ms!r}")
        self.host, self.port, self.store_port = host, port, store_port
        self.rules = rules or QuorumRules()
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._token = token.encode() if token else None
        self._replicas: dict[str, _Replica] = {}
        self._alive: set[str] = set()
        self._pending: dict[str, QuorumRequest] = {}
        self._waiters: dict[str, asyncio.Future[Response]] = {}
        self._previous: Quorum | None = None
        self._answer: Response | None = None  # the encoded answer of _previous
        # The members _previous was answered to, alive since: only their ranks learn their quorum rank from heartbeats
        # (a new incarnation of a member must not take an answer meant for its predecessor).
        self._answered: set[str] = set()
        # Every rank of a group heartbeats on its own connection, keyed (replica_id, rank): the close of any one
        # means a process of the group died, and a group dies whole.
        self._liveness: dict[tuple[str, int], Connection] = {}
        self._liveness_of: dict[Connection, tuple[str, int]] = {}
        # Cheap counters so an arrival costs O(1) and decide() (O(n)) runs only when it could answer:
        # _asked = |pending & alive|; _ref = previous members (or, with no previous quorum, those the requests
        # name); _ref_asked = |_ref & pending & alive|; _oldest = a lower bound of the candidates' arrival.
        self._asked = 0
        self._ref_id, self._ref, self._ref_asked = -1, frozenset[str](), 0
        self._oldest = _NEVER
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
        """Bind the HTTP server and the TCPStore (an OSError if a port is taken); ``port`` becomes the real one."""
        from torch.distributed import TCPStore  # heavy import, only when a lighthouse actually runs

        self._store = TCPStore(self.host, self.store_port, is_master=True, wait_for_workers=False)
        self.store_address = f"{self.host}:{self._store.port}"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connect, self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
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
        conn = Connection(self._route, self._connection_closed)
        self._connections.add(conn)
        return conn

    def _connection_closed(self, conn: Connection) -> None:
        self._connections.discard(conn)
        key = self._liveness_of.pop(conn, None)
        if key is not None and self._liveness.get(key) is conn:
            del self._liveness[key]
            if not self._stopping:
                self._declare_dead(key[0], f"the heartbeat connection of its rank {key[1]} closed")

    async def _route(self, request: Request) -> Response:
        self._authorize(request)
        if request.path not in self._routes:
            raise HttpError(404, f"unknown path {request.path!r}: use one of {', '.join(sorted(self._routes))}")
        method, handler = self._routes[request.path]
        if request.method != method:
            raise HttpError(405, f"{request.path} takes {method}, got {request.method}")
        return await handler(request)

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else request.query.get("token", "")
        if not hmac.compare_digest(given.encode(), self._token):
            what = "a wrong token" if given else "no token"
            raise HttpError(401, f"request has {what}: send 'Authorization: Bearer TOKEN' with the lighthouse's token")

    # ---- endpoints ----

    async def _heartbeat(self, request: Request) -> Response:
        body = request.json_object()
        replica_id = _replica_id(body)
        step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
        known_epoch, wait_ms = require_int(body, "known_epoch", None), require_int(body, "wait_ms", 0)
        rank = require_int(body, "rank", 0) if "rank" in body else 0
        self._check_shard_count(replica_id, shard_count)
        if rank > 0 and replica_id not in self._replicas:
            # Only a group's leader (re)creates it: a late heartbeat of a finishing rank after its leader left
            # must not bring the group back as a ghost the others would wait for.
            raise HttpError(404, f"replica {replica_id!r} is not known: its rank 0 must heartbeat first")
        self._touch(replica_id, step)
        key = (replica_id, rank)
        old = self._liveness.get(key)
        if old is not request.connection:
            # A newer connection replaces the older one; the older one's close then declares nothing.
            if old is not None:
                self._liveness_of.pop(old, None)
            self._liveness[key] = request.connection
            self._liveness_of[request.connection] = key
        if self._epoch == known_epoch and wait_ms > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._epoch_changed.wait(), min(wait_ms, MAX_LONG_POLL_MS) / 1000)
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
        body = request.json_object()
        replica_id = _replica_id(body)
        step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
        address = require(body, "address", str, "a string (may be empty)")
        commit_failed = require(body, "commit_failed", bool, "true or false")
        quorum_id, timeout_ms = require_int(body, "quorum_id", -1), require_int(body, "timeout_ms", 1)
        committed_in = require_int(body, "committed_in", -1)
        catching_up = require(body, "catching_up", bool, "true or false")
        if timeout_ms > MAX_QUORUM_TIMEOUT_MS:
            raise HttpError(400, f"field 'timeout_ms' must be at most {MAX_QUORUM_TIMEOUT_MS} (one hour), got "
                                 f"{timeout_ms}: a quorum request is bounded")
        members = require(body, "members", list, "a list of replica ids")
        for member in members:
            try:
                check_replica_id(member)
            except ValueError as e:
                raise HttpError(400, f"field 'members' has an invalid entry: {e}") from None
        self._check_shard_count(replica_id, shard_count)
        self._touch(replica_id, step)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response] = loop.create_future()
        request = QuorumRequest(replica_id, step, shard_count, time.monotonic(), address, commit_failed, quorum_id,
                                tuple(members), committed_in, catching_up)
        if self._answer is not None and is_late_member(self._previous, request):
            self._answered.add(replica_id)
            return self._answer
        self._add_pending(request, waiter)
        # A plain timer rather than asyncio.wait_for: fewer futures and callbacks per request when 10,000 groups ask.
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
                504, f"no quorum containing {replica_id!r} within timeout_ms={timeout_ms}: {self._asked} of "
                     f"{len(self._alive)} alive replicas asked, min_replicas={self.rules.min_replicas}; raise "
                     f"timeout_ms or start more replica groups"))

    async def _leave(self, request: Request) -> Response:
        body = request.json_object()
        replica_id = _replica_id(body)
        rank = require_int(body, "rank", 0) if "rank" in body else 0
        if replica_id not in self._replicas:
            raise HttpError(404, f"replica {replica_id!r} is not known to this lighthouse: nothing to leave")
        if rank > 0:
            # A non-leader rank finishing: only its liveness connection stops counting; the leader's leave (rank 0)
            # removes the group.
            conn = self._liveness.pop((replica_id, rank), None)
            if conn is not None:
                self._liveness_of.pop(conn, None)
            return json_response({})
        waiter = self._waiters.get(replica_id)
        self._set_alive(replica_id, False)
        self._drop_pending(replica_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(410, f"replica {replica_id!r} left while its quorum request was held"))
        del self._replicas[replica_id]
        for key in [k for k in self._liveness if k[0] == replica_id]:
            self._liveness_of.pop(self._liveness.pop(key), None)
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
        recover_src = quorum.recover_src if quorum else {}
        return {
            "quorum_id": quorum.quorum_id if quorum else -1,
            "epoch": self._epoch,
            "max_step": max((r.step for r in self._replicas.values()), default=-1),
            "min_replicas": self.rules.min_replicas,
            "members": list(quorum.member_ids) if quorum else [],
            "replicas": [
                {"replica_id": rid, "step": r.step, "alive": rid in self._alive, "dead": r.dead,
                 "heartbeat_age_s": round(now - r.last_seen, 3), "in_quorum": rid in members,
                 "pending": rid in self._pending}
                for rid, r in sorted(self._replicas.items())
            ],
            "recoveries": [{"replica_id": k, "source": v} for k, v in sorted(recover_src.items())],
            "store": self.store_address,
            "uptime_s": round(now - self._started_s, 3),
        }

    # ---- state changes (each keeps the counters exact) ----

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
        if alive == (replica_id in self._alive):
            return
        delta = 1 if alive else -1
        if alive:
            self._alive.add(replica_id)
        else:
            self._alive.discard(replica_id)
            self._answered.discard(replica_id)
        if replica_id in self._pending:
            self._asked += delta
            self._ref_asked += delta if replica_id in self._ref else 0
            if alive:
                self._oldest = min(self._oldest, self._pending[replica_id].arrived_s)

    def _add_pending(self, request: QuorumRequest, waiter: asyncio.Future[Response]) -> None:
        replica_id = request.replica_id
        old = self._waiters.get(replica_id)
        self._drop_pending(replica_id)
        if old is not None and not old.done():
            old.set_exception(HttpError(409, f"superseded by a newer quorum request from {replica_id!r}"))
        self._pending[replica_id] = request
        self._waiters[replica_id] = waiter
        if replica_id in self._alive:
            self._asked += 1
            self._ref_asked += replica_id in self._ref
            self._oldest = min(self._oldest, request.arrived_s)
        if self._previous is None and request.quorum_id > self._ref_id:
            self._set_ref()
        if self._join_timer is None:
            self._arm_join_timer()
        # Without a previous quorum (fresh or restarted) a healthy holder's request is adopted at once.
        self._schedule_decide(force=self._previous is None)

    def _drop_pending(self, replica_id: str) -> None:
        request = self._pending.pop(replica_id, None)
        self._waiters.pop(replica_id, None)
        if request is None:
            return
        if replica_id in self._alive:
            self._asked -= 1
            self._ref_asked -= replica_id in self._ref
        if self._previous is None and request.quorum_id == self._ref_id >= 0:
            self._set_ref()

    def _set_ref(self) -> None:
        if self._previous is not None:
            self._ref_id, self._ref = self._previous.quorum_id, frozenset(self._previous.member_ids)
        else:
            self._ref_id, self._ref = previous_from_requests(self._pending)
        self._ref_asked = sum(1 for rid in self._ref if rid in self._pending and rid in self._alive)

    def _bump_epoch(self) -> None:
        self._epoch += 1
        self._heartbeat_body = None
        self._epoch_changed.set()  # wakes every held long-poll; later polls wait on a fresh event
        self._epoch_changed = asyncio.Event()

    # ---- deciding ----

    def _could_be_ready(self) -> bool:
        """O(1) necessary condition of ``quorum.is_ready`` (never False when it would be True)."""
        if self._asked < self.rules.min_replicas or 2 * self._asked <= len(self._alive):
            return False
        if self._ref and self._ref_asked == len(self._ref):
            return True
        return self._asked == len(self._alive) or time.monotonic() >= self._oldest + self.rules.join_timeout_s

    def _schedule_decide(self, force: bool = False) -> None:
        """Decide at most once per event-loop turn, and on an arrival only when it could answer."""
        if self._decide_scheduled or not (force or self._could_be_ready()):
            return
        self._decide_scheduled = True
        asyncio.get_running_loop().call_soon(self._decide)

    def _decide(self) -> None:
        self._decide_scheduled = False
        if self._stopping:
            return
        receivers: frozenset[str] | None = None
        adopted = adopt(self._pending) if self._previous is None else None
        if adopted is not None:
            quorum, receivers = adopted
            log.info("adopting quorum %d (members %s) held by %s", quorum.quorum_id, ",".join(quorum.member_ids),
                     ",".join(sorted(receivers)))
        else:
            quorum = decide(self.rules, self._previous, self._pending, frozenset(self._alive), time.monotonic())
        if quorum is not None:
            if self._previous is not None and quorum.max_step < self._previous.max_step:
                log.warning("quorum %d restarts from step %d although step %d was committed: no group holding that "
                            "state is left, so it is lost; resume every group from a durable checkpoint to keep it",
                            quorum.quorum_id, quorum.max_step, self._previous.max_step)
            changed = self._previous is None or self._previous.quorum_id != quorum.quorum_id
            self._previous = quorum
            # A new membership is news; the same quorum answered again each step is not.
            log.log(logging.INFO if changed else logging.DEBUG, "quorum %d: members %s step %d%s", quorum.quorum_id,
                    ",".join(quorum.member_ids), quorum.max_step,
                    f" recover {dict(quorum.recover_src)}" if quorum.recover_src else "")
            body = json.dumps({**quorum.to_json(), "store": self.store_address}, separators=(",", ":")).encode()
            # One encoding shared by every member; compressed once when large (O(members^2) bytes otherwise).
            answer = self._answer = Response(200, body, gzipped=gzip.compress(body, 6) if len(body) > 16384 else None)
            self._answered = set(quorum.member_ids if receivers is None else receivers)
            for replica_id in self._answered:
                waiter = self._waiters.get(replica_id)
                self._drop_pending(replica_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)
            self._set_ref()
            self._bump_epoch()
        self._oldest = min((r.arrived_s for rid, r in self._pending.items() if rid in self._alive), default=_NEVER)
        self._arm_join_timer()

    def _arm_join_timer(self) -> None:
        """Wake at the oldest candidate's join deadline (never for a deadline already past: no busy loop)."""
        if self._join_timer is not None:
            self._join_timer.cancel()
            self._join_timer = None
        deadline = self._oldest + self.rules.join_timeout_s
        if deadline != _NEVER and deadline > time.monotonic():
            self._join_timer = asyncio.get_running_loop().call_at(deadline, self._join_deadline)

    def _join_deadline(self) -> None:
        self._join_timer = None
        self._schedule_decide(force=True)

    async def _expire_loop(self) -> None:
        timeout_s = self.heartbeat_timeout_ms / 1000
        while True:
            await asyncio.sleep(timeout_s / 10)
            cutoff = time.monotonic() - timeout_s
            for replica_id in [rid for rid in self._alive if self._replicas[rid].last_seen < cutoff]:
                self._declare_dead(replica_id, f"no heartbeat for over {self.heartbeat_timeout_ms} ms")

    def _check_shard_count(self, replica_id: str, shard_count: int) -> None:
        if self._previous is not None:
            expected, source = self._previous.shard_count, f"the current quorum {self._previous.quorum_id}"
        else:
            other = next((r for rid, r in self._pending.items() if rid != replica_id), None)
            if other is None:
                return
            expected, source = other.shard_count, f"the pending request of {other.replica_id!r}"
        if shard_count != expected:
            raise HttpError(409, f"shard_count {shard_count} of {replica_id!r} differs from shard_count {expected} of "
                                 f"{source}: every replica group must use the same number of shard ranks")


def _replica_id(body: dict[str, object]) -> str:
    try:
        return check_replica_id(require(body, "replica_id", str, "a replica id string"))
    except ValueError as e:
        raise HttpError(400, f"field 'replica_id': {e}") from None
