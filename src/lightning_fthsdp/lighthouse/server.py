"""The lighthouse: the job's quorum service and rendezvous store host (control plane, CPU only).

State is soft: replicas (last heartbeat, step, dead or not), pending quorum requests and the previous quorum.
A restarted lighthouse rebuilds it from the groups' heartbeats and requests (``quorum.decide`` continues the
numbering from the requests' ``quorum_id``/``members``; a request sends its members only when the lighthouse answers
428 for them). Failure detection: a replica whose heartbeat connection closes is declared dead at once (crash); one
silent for ``heartbeat_timeout_ms`` is declared dead by a timer (hang). Overload never makes a death: the lighthouse
measures how far it runs behind (``lag``), extends the hang deadline by twice that, and while behind leaves a closed
connection to the hang deadline. A leader sends its quorum requests on its heartbeat connection (one connection per
group), each with a request id, so they are handled while its heartbeat is held and answered as soon as decided
(``http.Connection``). A death or a leave answers the held heartbeat long-polls, which is how survivors learn to
abort an in-flight allreduce: at once, and at most once per ``WAKE_WINDOW_S`` (a burst of deaths is one wake, not
one per death). A revival and a new quorum wake nobody (``news``): a round costs one answer per group, not two.

The HTTP API is summarised on :class:`Lighthouse`; every rejected request leaves the state as it was. The server is
the I/O shell (sockets, the store, timers, routing) over parts that take ``now`` as an input: ``claims`` (what a
request claims, checked first), ``liveness`` (who lives), ``heartbeats`` (the held heartbeats and their answer),
``news`` (when the held heartbeats hear of a change), ``held`` (the held quorum requests), ``excluder`` (partitions
and stragglers), ``rounds`` and ``decider`` (the quorum rounds and their decisions, by the rules of ``quorum``),
``readiness`` (whether a decision would answer, kept per event), ``status_view`` and ``views`` (what it shows);
``api`` encodes the quorum answer. The request bodies are parsed by ``protocol.requests``, the wire format the ranks'
side encodes them with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Iterable
from typing import Any

from lightning_fthsdp.lighthouse import lanes
from lightning_fthsdp.lighthouse.admission import Admission, OutsiderLimits, raise_open_files_limit
from lightning_fthsdp.lighthouse.api import authorize
from lightning_fthsdp.lighthouse.claims import Claims
from lightning_fthsdp.lighthouse.deadlines import Deadlines
from lightning_fthsdp.lighthouse.decider import Decider
from lightning_fthsdp.lighthouse.excluder import Excluder
from lightning_fthsdp.lighthouse.heartbeats import HeartbeatAnswers, HeldHeartbeats
from lightning_fthsdp.lighthouse.held import HeldRequests
from lightning_fthsdp.lighthouse.http import IDLE_TIMEOUT_S, REQUEST_TIMEOUT_S, Connection
from lightning_fthsdp.lighthouse.lag import Lag
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.listener import Listener
from lightning_fthsdp.lighthouse.liveness import GroupConnections, HeartbeatConnections, Liveness
from lightning_fthsdp.lighthouse.messages import Handler, HttpError, Pending, Request, Response, json_response
from lightning_fthsdp.lighthouse.news import HeartbeatNews
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import GroupRecord, Registry
from lightning_fthsdp.lighthouse.rounds import Rounds, RoundTiming
from lightning_fthsdp.lighthouse.status_view import StatusView
from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy
from lightning_fthsdp.lighthouse.views import metrics_of, view_routes
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import check_replica_id
from lightning_fthsdp.protocol.requests import parse_checkpoint, parse_heartbeat, parse_leave, parse_lost, parse_quorum

log = logging.getLogger("fthsdp.lighthouse")

MAX_LONG_POLL_MS = 5_000
WAKE_WINDOW_S = 0.02
"""Shortest time between two wakes of the held heartbeats: deaths closer together than this are told in one."""
BEHIND_SHARE = 0.5
"""The lighthouse counts as behind (``lag.Lag``) when its timers run later than this share of the heartbeat timeout:
a client gives up on a heartbeat answered a timeout late, and its connection's close is then no crash."""


class Lighthouse:
    """Quorum service. ``start()`` binds the HTTP port and the TCPStore; ``stop()`` closes every connection.

    Both listen on ``host`` only. ``token``: when set, every request needs it in the ``Authorization`` header
    (Bearer, or Basic with the token as the password, for a browser), else 401; the groups also derive their
    rendezvous key prefixes on the store from it. ``request_timeout_s`` and ``idle_timeout_s`` bound slow and idle
    connections (see ``lighthouse.http``). ``startup_grace_ms`` (default: the heartbeat timeout): a lighthouse that
    may replace one that died forms no quorum of its own (it adopts one a healthy group holds) for this long after it
    starts, so every live group has reconnected first; a fresh group asking at once must not start the job over from
    step 0 while a group holding the job's state is still on its way back. ``straggler_policy`` (default: ``off``,
    measure and show only): what it does about groups that drag every step (``lighthouse.stragglers``).
    ``outsider_limits`` (default: from the open-files limit, raised to its hard limit at ``start()``): the caps on
    connections that have not passed the token check (``lighthouse.admission``). ``shard_count``: every group's shard
    ranks, the job's (``fthsdp launch``, ``slurm`` and ``k8s`` pass it): a group with another count is refused (409);
    None: the live groups' (``api.check_shard_count``).

    Endpoints (JSON):
    ``POST /v1/heartbeat`` (long-poll on the epoch), ``POST /v1/quorum`` (held until a quorum containing the
    requester is decided, 504 after ``timeout_ms``; see ``protocol.requests.parse_quorum`` for the request,
    ``api.QuorumAnswers`` for the answer, full or a delta against the quorum the requester holds), ``POST /v1/leave``
    (graceful exit), ``POST /v1/lost`` (a group's leader reports a rank it lost: the group is dead while one is),
    ``POST /v1/checkpoint`` (a writing group reports a complete durable checkpoint), ``GET /status``, ``GET /events``
    (the event log and membership history, see ``lighthouse.watch``; ``?after=SEQ`` for the newer events only),
    ``GET /`` (the status page) and ``GET /metrics`` (Prometheus text, see ``lighthouse.metrics``).
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
        replica_ids: Iterable[str] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        startup_grace_ms: int | None = None,
        straggler_policy: StragglerPolicy | None = None,
        outsider_limits: OutsiderLimits | None = None,
        shard_count: int | None = None,
    ) -> None:
        if not isinstance(heartbeat_timeout_ms, int) or heartbeat_timeout_ms <= 0:
            raise ValueError(f"Lighthouse heartbeat_timeout_ms must be an integer > 0, got {heartbeat_timeout_ms!r}")
        for name, value in (("request_timeout_s", request_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Lighthouse {name} must be a number of seconds > 0, got {value!r}")
        self._request_timeout_s, self._idle_timeout_s = float(request_timeout_s), float(idle_timeout_s)
        startup_grace_ms = heartbeat_timeout_ms if startup_grace_ms is None else startup_grace_ms
        if not isinstance(startup_grace_ms, int) or startup_grace_ms < 0:
            raise ValueError(f"Lighthouse startup_grace_ms must be an integer >= 0, got {startup_grace_ms!r}")
        declared = None if replica_ids is None else frozenset(_declared_id(rid) for rid in replica_ids)
        if shard_count is not None and (not isinstance(shard_count, int) or isinstance(shard_count, bool)
                                        or shard_count < 1):
            raise ValueError(f"Lighthouse shard_count must be an integer >= 1 (every group's shard ranks), or None to "
                             f"take the live groups', got {shard_count!r}")
        self.shard_count = shard_count
        if declared is not None and not declared:
            raise ValueError("Lighthouse replica_ids is empty: name the job's replica ids, or pass None to admit any")
        self.host, self.port, self.store_port = host, port, store_port
        self.rules = rules or QuorumRules()
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._token = token.encode() if token else None
        self._registry = Registry(declared, grace_s=self.rules.join_timeout_ms / 1000)
        self._ledger = CommitLedger()
        self._watch = Watch(metrics_of(self.status))
        # Alive groups and pending requests live in _readiness, which keeps decide() (O(n)) to the arrivals that
        # would form a quorum; the server changes them only through it.
        self._readiness = Readiness(self.rules)
        self._claims = Claims(self._registry, self._ledger, self._readiness, shard_count)
        self._lag = Lag(heartbeat_timeout_ms / 1000, BEHIND_SHARE * heartbeat_timeout_ms / 1000)
        self._deadlines = Deadlines(ran=self._lag.ran)
        self._held = HeldRequests(self._deadlines, self._readiness, self._request_changed,
                                  self._decide_soon, self.rules.min_replicas)
        self._excluder = Excluder(self.rules, heartbeat_timeout_ms, self._registry, self._readiness, self._watch,
                                  self._deadlines, straggler_policy or StragglerPolicy(), self._held.take,
                                  self._decide_soon, time.monotonic)
        self._heartbeat_connections = HeartbeatConnections()
        self._liveness = Liveness(self._registry, self._ledger, self._readiness, self._watch,
                                  self._heartbeat_connections, self._held, self._excluder, self._died,
                                  lambda: self._news.revived(), self._stopped_counting)
        self._group_connections = GroupConnections()
        self._decider = Decider(self.rules, self._ledger, self._watch, self._readiness,
                                self._excluder.exclude_partitioned, self._claims.seen_committed,
                                lambda: self._registry.highest_step(
                                    self._readiness.alive - self._readiness.pending.keys()),
                                startup_grace_ms / 1000, time.monotonic())
        self._rounds = Rounds(self.rules, self._decider, self._readiness, self._registry, self._held,
                              lambda: self._news.changed(), self._watch.round_timed)
        self._heartbeat_answers = HeartbeatAnswers(self._registry, self._rounds, heartbeat_timeout_ms)
        self._heartbeats = HeldHeartbeats(self._deadlines, self._heartbeat_answers.to, WAKE_WINDOW_S)
        self._news = HeartbeatNews(self._heartbeat_answers, self._heartbeats)
        self._status_view = StatusView(self.rules, self._registry, self._ledger, self._readiness, self._watch,
                                       self._excluder.stragglers, self._excluder.exclusions, self._lag,
                                       self._decider.lost, self._heartbeat_connections, self._group_connections)
        self._connections: set[Connection] = set()
        self._outsider_limits = outsider_limits
        self._admission: Admission | None = None  # its caps follow the open-files limit, raised at start
        self._listener: Listener | None = None
        self._store: Any = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.store_address = ""
        self._routes: dict[str, tuple[str, Handler]] = {
            "/v1/heartbeat": ("POST", self._heartbeat),
            "/v1/quorum": ("POST", self._quorum),
            "/v1/leave": ("POST", self._leave),
            "/v1/lost": ("POST", self._lost),
            "/v1/checkpoint": ("POST", self._checkpoint),
            **view_routes(self._watch, self.status),
        }

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def last_round(self) -> RoundTiming | None:
        """The timing of the last decision that answered held quorum requests (``rounds.RoundTiming``); None before
        the first. Also ``/status``'s ``last_round``, without building the whole document."""
        return self._rounds.last_round

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
            http_socket = _listen_socket(self.host, self.port)
        except BaseException:
            store_socket.close()
            raise
        open_files = raise_open_files_limit()
        self._admission = Admission(self._outsider_limits or OutsiderLimits.for_open_files(open_files))
        self._listener = Listener(http_socket, self._connect, self._admission)
        self.port = http_socket.getsockname()[1]
        store_port = store_socket.getsockname()[1]
        try:
            # The store owns the descriptor from here on and closes it when it stops.
            self._store = TCPStore(self.host, store_port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=store_socket.detach())
        except BaseException:
            self._listener.close()
            raise
        self.store_address = self._rounds.store_address = f"{self.host}:{store_port}"
        self._expiry_task = loop.create_task(self._expire_loop())
        self._decider.started_s = time.monotonic()
        # This lighthouse may replace one that died: the groups holding the job's state get as long to come back
        # (and be believed) as a quorum below the committed step waits for them.
        self._ledger.settles_at = self._decider.started_s + self.rules.lost_state_wait_ms / 1000
        log.info("lighthouse on %s, store %s, %s, heartbeat timeout %d ms; open-files limit %d (about as many "
                 "replica groups at most: raise the hard limit, ulimit -Hn, for more), connections without the token "
                 "capped at %d (%d per address)", self.url, self.store_address, self.rules, self.heartbeat_timeout_ms,
                 open_files, self._admission.limits.total, self._admission.limits.per_source)

    async def stop(self) -> None:
        """Close the server and every connection (held requests are dropped); declares nobody dead."""
        self._stopping = True
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        self._rounds.close()
        self._news.close()
        self._deadlines.close()
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._connections):
            conn.close()
        await asyncio.sleep(0)  # the closes complete on the next turn
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
        conn = Connection(self._route, self._connection_closed, self._request_timeout_s, self._idle_timeout_s,
                          gate=functools.partial(authorize, token=self._token),
                          on_authenticated=self._authenticated)
        self._connections.add(conn)
        return conn

    def _authenticated(self, conn: Connection) -> None:
        assert self._admission is not None, "connections are made only once the lighthouse started"
        self._admission.authenticated(conn)
        if (fd := conn.fileno()) is not None:
            lanes.settle(fd)

    def _connection_closed(self, conn: Connection) -> None:
        self._connections.discard(conn)
        if (fd := conn.fileno()) is not None:
            lanes.forget(fd)
        assert self._admission is not None, "connections are made only once the lighthouse started"
        self._admission.closed(conn)
        self._group_connections.closed(conn)
        key = self._heartbeat_connections.closed(conn)
        if key is None or self._stopping:
            return
        now = time.monotonic()
        if self._lag.behind(now):
            # Its client may only have given up on an answer this lighthouse was late with: the hang deadline,
            # extended by the lag, tells a dead group from one that reconnects.
            log.info("the heartbeat connection of replica %s rank %d closed while the lighthouse runs behind (%s): "
                     "left to the heartbeat timeout", key[0], key[1], self._lag.to_json(now))
            return
        self._liveness.declare_dead(key[0], "crash", f"the heartbeat connection of its rank {key[1]} closed", now,
                                    self._rounds.quorum)

    def _route(self, request: Request) -> Response | Pending:
        # The token was checked on the request's head (the connection's gate, see _connect).
        if request.path not in self._routes:
            raise HttpError(404, f"unknown path {request.path!r}: use one of {', '.join(sorted(self._routes))}")
        method, handler = self._routes[request.path]
        if request.method != method:
            raise HttpError(405, f"{request.path} takes {method}, got {request.method}")
        return handler(request)

    # ---- endpoints ----

    def _heartbeat(self, request: Request) -> Response | Pending:
        beat = request.parsed(parse_heartbeat)
        replica_id = beat.replica_id
        self._claims.check_shard_count(replica_id, beat.shard_count, self._rounds.quorum)
        # Only a group's leader (re)creates it: a late heartbeat of a finishing rank after its leader left must not
        # bring the group back as a ghost the others would wait for.
        self._registry.check(replica_id, beat.incarnation, beat.rank)
        now = time.monotonic()
        self._claims.check_heartbeat(replica_id, beat.incarnation, beat.step, now)
        record = self._admit(replica_id, beat.incarnation, beat.step, now)
        if beat.losses >= record.losses:  # else sent before the newest loss report: it revives nothing
            record.losses, record.lost = beat.losses, beat.lost
            if beat.lost:
                cause = "hang" if set(beat.lost) <= set(beat.lost_hung) else "crash"
                self._liveness.declare_dead(replica_id, cause, _loss(beat.lost, cause), now, self._rounds.quorum)
            self._liveness.touch(record, replica_id, beat.step, now)
        self._heartbeat_connections.bind((replica_id, beat.rank), request.connection)
        self._group_connections.carried(replica_id, request.connection)
        if self._heartbeats.epoch == beat.known_epoch and beat.wait_ms > 0:
            return self._heartbeats.hold(request, replica_id, min(beat.wait_ms, MAX_LONG_POLL_MS) / 1000)
        return self._heartbeat_answers.to(replica_id, self._heartbeats.epoch)

    def _quorum(self, request: Request) -> Response | Pending:
        now = time.monotonic()
        asked, incarnation, timeout_ms, caught_up, timing = request.parsed(lambda body: parse_quorum(body, now))
        replica_id = asked.replica_id
        self._claims.check_shard_count(replica_id, asked.shard_count, self._rounds.quorum)
        self._registry.check(replica_id, incarnation, 0)
        self._claims.check_request(asked, incarnation, now, self._rounds.quorum, self._rounds.answers)
        self._liveness.touch(self._admit(replica_id, incarnation, asked.step, now), replica_id, asked.step, now)
        self._group_connections.carried(replica_id, request.connection)
        self._registry.addressed(replica_id, asked.address)
        if asked.commit_failed:
            self._watch.discarded(replica_id, asked.step)
            for rid, refusal in self._claims.discarded(asked).items():
                self._fail_pending(rid, refusal)
        if caught_up is not None:
            self._watch.caught_up(replica_id, caught_up.source, caught_up.step, caught_up.nbytes, caught_up.fetch_s)
        if timing is not None:
            self._excluder.note_timing(asked, timing, self._rounds.quorum, now)
        asked, answer = self._excluder.screen(request, asked, timeout_ms, self._rounds.quorum, self._liveness.changes,
                                               now)
        if answer is not None:
            return answer
        return self._rounds.ask(request, asked, timeout_ms, now)

    def _leave(self, request: Request) -> Response:
        replica_id, rank, incarnation = request.parsed(parse_leave)
        self._registry.owner(replica_id, incarnation)
        if rank > 0:
            # A non-leader rank finishing: only its heartbeat connection stops counting; the leader's leave (rank 0)
            # removes the group.
            self._heartbeat_connections.release((replica_id, rank))
            return json_response({})
        self._registry.remove(replica_id)
        self._excluder.forget(replica_id)
        self._fail_pending(replica_id, HttpError(410, f"replica {replica_id!r} left while its quorum request was held"))
        self._heartbeat_connections.release_group(replica_id)
        log.info("replica %s left", replica_id)
        self._watch.left(replica_id)
        self._news.new_epoch()
        self._rounds.schedule(force=True)
        return json_response({})

    def _lost(self, request: Request) -> Response:
        lost = request.parsed(parse_lost)
        record = self._registry.owner(lost.replica_id, lost.incarnation)
        record.losses = max(record.losses, lost.losses)
        record.lost = tuple(sorted({*record.lost, lost.rank}))
        self._liveness.declare_dead(lost.replica_id, lost.cause, _loss((lost.rank,), lost.cause), time.monotonic(),
                                    self._rounds.quorum)
        return json_response({})

    def _checkpoint(self, request: Request) -> Response:
        replica_id, incarnation, step, path = request.parsed(parse_checkpoint)
        self._registry.owner(replica_id, incarnation)
        self._ledger.note_checkpoint(step, path, replica_id)
        log.info("replica %s wrote the checkpoint of step %d at %s", replica_id, step, path)
        checkpoint = self._ledger.checkpoint
        return json_response({"checkpoint": checkpoint.to_json() if checkpoint else None})

    def status(self) -> dict[str, object]:
        """The ``GET /status`` document (``StatusView.document``)."""
        return self._status_view.document(time.monotonic(), self._rounds.quorum, self._heartbeats.epoch,
                                          self.store_address, self._decider.started_s, self.last_round)

    # ---- state changes ----

    def _admit(self, replica_id: str, incarnation: str, step: int, now: float) -> GroupRecord:
        """The group's record, spoken for by ``incarnation`` (checked already) which claims ``step``. A new
        incarnation replacing a dead one takes nothing of it: its held request is refused and its ranks' connections
        mean nothing."""
        record, new = self._registry.admit(replica_id, incarnation, now)
        if new:
            self._watch.joined(replica_id, record.incarnations, step)
            self._fail_pending(replica_id, HttpError(409, f"replica {replica_id!r} was restarted: a new "
                                                          f"incarnation replaced this one"))
            self._heartbeat_connections.release_group(replica_id)
            self._stopped_counting(replica_id)
        return record

    def _stopped_counting(self, replica_id: str) -> None:
        """The group stopped counting, or is a new incarnation: only the members answered the newest quorum, alive
        since, learn their rank in it from heartbeats."""
        self._rounds.answered.discard(replica_id)

    def _died(self) -> None:
        """A death: the held heartbeats learn it (a new epoch) and a decision may leave the group out."""
        self._news.new_epoch()
        self._rounds.schedule(force=True)

    def _fail_pending(self, replica_id: str, error: HttpError) -> None:
        """End the group's held quorum request, if any, with ``error``."""
        waiter = self._held.take(replica_id)
        if waiter is not None:
            waiter.fail(error)

    def _request_changed(self, replica_id: str) -> None:
        """The group's held quorum request came or went."""
        asked = self._readiness.pending.get(replica_id)
        self._excluder.reported(replica_id, asked.unreachable if asked is not None else None)
        self._liveness.sync(replica_id, time.monotonic())

    def _decide_soon(self) -> None:
        self._rounds.schedule(force=True)

    async def _expire_loop(self) -> None:
        timeout_s = self.heartbeat_timeout_ms / 1000
        while True:
            planned = time.monotonic() + timeout_s / 10
            self._lag.expect(planned)
            await asyncio.sleep(timeout_s / 10)
            now = time.monotonic()
            self._lag.ran(planned, now)
            decide, strays = self._liveness.expire(now, self.heartbeat_timeout_ms, self._lag.grace_s(now),
                                                   self._rounds.quorum)
            if decide:
                self._rounds.schedule(force=True)
            if strays:
                self._news.changed()  # their deaths leave the heartbeat answers' "dead" list
                for replica_id in strays:
                    self._excluder.forget(replica_id)


def _loss(ranks: Iterable[int], cause: str) -> str:
    """Why a group whose leader lost ``ranks`` is dead, in the same words whichever report (its heartbeat or its
    ``POST /v1/lost``) came first."""
    how = ("its connection to the leader closed" if cause == "crash" else
           "it sent the leader nothing for the heartbeat timeout")
    return f"its leader lost rank {','.join(map(str, ranks))}: {how}"


def _declared_id(replica_id: str) -> str:
    try:
        return check_replica_id(replica_id)
    except ValueError as e:
        raise ValueError(f"Lighthouse replica_ids: {e}") from None


def _listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s first address (IPv4 or IPv6) and ``port`` (0: a free one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)
