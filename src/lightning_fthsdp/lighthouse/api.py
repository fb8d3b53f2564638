"""The lighthouse API at its edge: the token check, each endpoint's request body parsed and validated, and the
encoded quorum answer.

Every check raises :class:`~lightning_fthsdp.lighthouse.messages.HttpError` naming the field, the value and the fix, and
runs before the server changes any state, so a rejected request leaves the lighthouse as it was.
"""

from __future__ import annotations

import base64
import binascii
import functools
import gzip
import hmac
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lightning_fthsdp.config.addresses import state_server_location
from lightning_fthsdp.lighthouse.exclusions import Exclusion
from lightning_fthsdp.lighthouse.messages import HttpError, Request, Response, json_response, require, require_int
from lightning_fthsdp.lighthouse.registry import check_incarnation
from lightning_fthsdp.lighthouse.stragglers import MAX_STEP_S
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest, check_replica_id

MAX_QUORUM_TIMEOUT_MS = 3_600_000
GZIP_OVER_BYTES = 16384
"""Quorum answers larger than this are also sent gzip-compressed to clients that accept it."""
MAX_DIGEST = 64
"""Longest ``members_digest`` a quorum request may send (``Quorum.members_digest`` is 32 hex digits)."""
MAX_UNREACHABLE = 64
"""Most groups one request may report unreachable: as many as the probe targets the lighthouse hands out at most."""
KEPT_BASES = 8
"""Member lists kept as bases of delta answers: the newest answered. A steady group holds the newest one; after a few
changes in a row, or an answer lost on its way, an older one."""


@dataclass(frozen=True)
class HeartbeatRequest:
    """``POST /v1/heartbeat``: one rank's sign of life, and a long-poll on the lighthouse's epoch."""

    replica_id: str
    incarnation: str
    rank: int
    step: int
    shard_count: int
    known_epoch: int
    """The epoch the rank last saw: while it is still the lighthouse's, the answer is held up to ``wait_ms``."""
    wait_ms: int
    lost: tuple[int, ...] = ()
    """The ranks of the group its leader has lost now (``membership.relay``): the group stays dead while any
    is. Empty from a client that heartbeats per rank."""
    losses: int = 0
    """How many ranks the leader has lost so far: a heartbeat reporting fewer losses than the lighthouse knows was
    sent before the newest one and revives nothing."""
    lost_hung: tuple[int, ...] = ()
    """Those of ``lost`` that went silent (a hang); the others' connections closed (a crash). The heartbeat may
    reach the lighthouse before the leader's ``POST /v1/lost``: either one names the cause."""


@dataclass(frozen=True)
class CaughtUp:
    """A quorum request's optional ``caught_up``: the group's leader finished a catch-up since its last request."""

    source: str
    """The group that delivered the state."""
    step: int
    """The step whose state it loaded."""
    nbytes: int
    """Bytes of state the leader (shard rank 0) fetched: its own shard's part of the group's state."""
    fetch_s: float
    """Seconds from the start of the transfer to the state loaded and the steps held since replayed."""


@dataclass(frozen=True)
class StepTiming:
    """A quorum request's optional ``compute_s`` and ``wait_s``: the times of the requester's last step, for
    ``lighthouse.stragglers``."""

    compute_s: float
    """Seconds the group spent on its own: from the end of its previous commit to the start of the exchange, the
    wait for the quorum answer left out."""
    wait_s: float | None
    """Seconds its exchange took, waiting for the others included (None: it did not exchange, e.g. excluded)."""


def authorize(request: Request, token: bytes | None) -> None:
    """Refuse (401) a request without the lighthouse's token, when it has one.

    The token travels only in the ``Authorization`` header: ``Bearer TOKEN`` for programs, or HTTP Basic with the
    token as the password (any user name) for a browser, which prompts for it on the 401's ``WWW-Authenticate``.
    A token in the URL is refused even when the header is right: URLs end up in proxy and access logs.
    """
    if token is None:
        return
    if "token" in request.query:
        raise HttpError(401, "a token in the URL (?token=) is refused because URLs are logged: send it in the "
                             "'Authorization: Bearer TOKEN' header (a browser: the password of the login prompt)",
                        _CHALLENGE)
    given = _header_token(request.headers.get("authorization", ""))
    if not hmac.compare_digest(given, token):
        what = "a wrong token" if given else "no token"
        raise HttpError(401, f"request has {what}: send 'Authorization: Bearer TOKEN' with the lighthouse's token "
                             f"(a browser: the token as the password of the login prompt)", _CHALLENGE)


_CHALLENGE = (("WWW-Authenticate", 'Basic realm="fthsdp lighthouse", charset="UTF-8"'),)
"""Makes a browser prompt for credentials; ``authorize`` takes the password as the token."""


def _header_token(header: str) -> bytes:
    """The token an ``Authorization`` header carries (b"" when none): Bearer, or the password of Basic."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode("latin-1")  # the head was decoded as latin-1: the bytes as sent
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]
    return b""


def parse_heartbeat(request: Request) -> HeartbeatRequest:
    body = request.json_object()
    replica_id = _replica_id(body)
    step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
    known_epoch, wait_ms = require_int(body, "known_epoch", None), require_int(body, "wait_ms", 0)
    losses = require_int(body, "losses", 0) if "losses" in body else 0
    lost = require(body, "lost", list, "a list of ranks >= 1") if "lost" in body else []
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 < r < shard_count for r in lost):
        raise HttpError(400, f"field 'lost' must list ranks from 1 to shard_count - 1 = {shard_count - 1}, got "
                             f"{lost!r}")
    hung = require(body, "lost_hung", list, "a list of ranks of 'lost'") if "lost_hung" in body else []
    if not all(isinstance(r, int) and not isinstance(r, bool) and r in lost for r in hung):
        raise HttpError(400, f"field 'lost_hung' must list ranks of 'lost' ({lost!r}) that went silent, got {hung!r}")
    return HeartbeatRequest(replica_id, _incarnation(body), _rank(body), step, shard_count, known_epoch, wait_ms,
                            tuple(lost), losses, tuple(hung))


LOSS_CAUSES = ("crash", "hang")


@dataclass(frozen=True)
class LostRequest:
    """``POST /v1/lost``: a group's leader reports at once that it lost one of its other ranks."""

    replica_id: str
    incarnation: str
    rank: int
    """The rank lost (>= 1: the leader reports only others)."""
    cause: str
    """``crash`` (its connection to the leader closed) or ``hang`` (it sent nothing for the heartbeat timeout)."""
    losses: int
    """The leader's count of ranks lost so far, this one included."""


def parse_lost(request: Request) -> LostRequest:
    body = request.json_object()
    replica_id, incarnation = _replica_id(body), _incarnation(body)
    rank, losses = require_int(body, "lost_rank", 1), require_int(body, "losses", 1)
    cause = require(body, "cause", str, f"one of {', '.join(LOSS_CAUSES)}")
    if cause not in LOSS_CAUSES:
        raise HttpError(400, f"field 'cause' must be one of {', '.join(LOSS_CAUSES)}, got {cause!r}")
    return LostRequest(replica_id, incarnation, rank, cause, losses)


def parse_quorum(request: Request,
                 arrived_s: float) -> tuple[QuorumRequest, str, int, CaughtUp | None, StepTiming | None]:
    """``POST /v1/quorum``: the quorum request, the requester's incarnation, how long (ms) it waits for the answer,
    the catch-up it reports (optional field ``caught_up``: ``source``, ``step``, ``bytes``, ``fetch_s``) and the
    times of its last step (optional fields ``compute_s`` and ``wait_s``, see ``StepTiming``; ``wait_s`` only with
    ``compute_s``).

    Fields: ``replica_id``, ``incarnation``, ``step``, ``shard_count``, ``address``, ``commit_failed``,
    ``committed_in``, ``following``, ``timeout_ms``, ``exchange_failed`` (optional: its last cross-group collective
    failed), ``rendezvous_failed`` (optional: it could not build its quorum's cross-group group), ``unreachable``
    (optional: the probe targets it could not reach, after a ``probe_answer``); of the quorum the requester holds,
    ``quorum_id`` (-1: none), ``members_digest`` (optional, ``Quorum.members_digest``: lets the answer be a delta) and
    ``members`` (optional, its member ids: sent only when the lighthouse answers 428 because it needs them, then at
    once with the same
    request). The answer (``QuorumAnswers``) is the quorum with ``store``, the rendezvous store's address."""
    body = request.json_object()
    replica_id, incarnation = _replica_id(body), _incarnation(body)
    step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
    address = _state_addresses(require(body, "address", str, "a string (may be empty)"))
    commit_failed = require(body, "commit_failed", bool, "true or false")
    quorum_id, timeout_ms = require_int(body, "quorum_id", -1), require_int(body, "timeout_ms", 1)
    committed_in = require_int(body, "committed_in", -1)
    following = require(body, "following", bool, "true or false")
    if timeout_ms > MAX_QUORUM_TIMEOUT_MS:
        raise HttpError(400, f"field 'timeout_ms' must be at most {MAX_QUORUM_TIMEOUT_MS} (one hour), got "
                             f"{timeout_ms}: a quorum request is bounded")
    members = _replica_ids(body, "members", "a list of replica ids") if "members" in body else ()
    digest = ""
    if "members_digest" in body:
        digest = require(body, "members_digest", str, 'a string: the members digest of the quorum held ("": none)')
    if len(digest) > MAX_DIGEST:
        raise HttpError(400, f"field 'members_digest' must be at most {MAX_DIGEST} characters (the digest the client "
                             f"computes), got {len(digest)}")
    exchange_failed = require(body, "exchange_failed", bool, "true or false") if "exchange_failed" in body else False
    rendezvous_failed = require(body, "rendezvous_failed", bool, "true or false") \
        if "rendezvous_failed" in body else False
    unreachable = None
    if body.get("unreachable") is not None:
        unreachable = _replica_ids(body, "unreachable", "a list of replica ids (or null: not probed)")
        if len(unreachable) > MAX_UNREACHABLE:
            raise HttpError(400, f"field 'unreachable' names {len(unreachable)} groups, more than {MAX_UNREACHABLE}: a "
                                 f"group reports only the probe targets the lighthouse gave it")
    request = QuorumRequest(replica_id, step, shard_count, arrived_s, address, commit_failed, quorum_id,
                            members=members, members_digest=digest, committed_in=committed_in,
                            following=following, unreachable=unreachable, exchange_failed=exchange_failed,
                            rendezvous_failed=rendezvous_failed)
    return request, incarnation, timeout_ms, _caught_up(body), _step_timing(body)


@functools.lru_cache(maxsize=1 << 15)
def _state_addresses(addresses: str) -> str:
    """Field ``address``: every rank's state-server address, comma separated ("": it serves none). Checked once per
    distinct value (a refused one raises, so it is never kept): a group sends the same addresses every step."""
    for entry in addresses.split(",") if addresses else ():
        if state_server_location(entry) is None:
            raise HttpError(400, f"field 'address' must list each rank's state server as http://HOST:PORT (comma "
                                 f"separated, or empty when the group serves none), got {entry!r} in "
                                 f"{addresses[:200]!r}")
    return addresses


def _step_timing(body: dict[str, object]) -> StepTiming | None:
    compute_s, wait_s = _seconds(body, "compute_s"), _seconds(body, "wait_s")
    if compute_s is None:
        if wait_s is not None:
            raise HttpError(400, "field 'wait_s' needs 'compute_s' in the same request: send both times of the step, "
                                 "or neither")
        return None
    return StepTiming(compute_s, wait_s)


def _seconds(body: dict[str, object], name: str) -> float | None:
    """The optional duration ``body[name]`` (absent or null: None)."""
    if body.get(name) is None:
        return None
    value = require(body, name, float | int, f"a number of seconds from 0 to {MAX_STEP_S:g} (or null)")
    if not 0 <= value <= MAX_STEP_S:
        raise HttpError(400, f"field {name!r} must be a number of seconds from 0 to {MAX_STEP_S:g} (one day), got "
                             f"{value!r}")
    return float(value)


def _caught_up(body: dict[str, object]) -> CaughtUp | None:
    if body.get("caught_up") is None:
        return None
    report = require(body, "caught_up", dict, "an object with source, step, bytes and fetch_s (or null)")
    try:
        source = check_replica_id(require(report, "source", str, "the replica id that delivered the state"))
    except ValueError as e:
        raise HttpError(400, f"field 'caught_up.source': {e}") from None
    fetch_s = require(report, "fetch_s", float | int, "a number of seconds >= 0")
    if not 0 <= fetch_s < float("inf"):
        raise HttpError(400, f"field 'fetch_s' of 'caught_up' must be a number of seconds >= 0, got {fetch_s!r}")
    return CaughtUp(source, require_int(report, "step", 0), require_int(report, "bytes", 0), float(fetch_s))


MAX_CHECKPOINT_PATH = 4096


def parse_checkpoint(request: Request) -> tuple[str, str, int, str]:
    """``POST /v1/checkpoint``: (replica_id, incarnation, step, path) of a complete checkpoint its writer reports."""
    body = request.json_object()
    replica_id, incarnation, step = _replica_id(body), _incarnation(body), require_int(body, "step", 0)
    path = require(body, "path", str, "the checkpoint's folder (a string)")
    if not 0 < len(path) <= MAX_CHECKPOINT_PATH or any(ord(c) < 32 for c in path):
        raise HttpError(400, f"field 'path' must be 1-{MAX_CHECKPOINT_PATH} printable characters, got {path[:80]!r}")
    return replica_id, incarnation, step, path


def parse_leave(request: Request) -> tuple[str, int, str]:
    """``POST /v1/leave``: (replica_id, rank, incarnation) of a rank finishing."""
    body = request.json_object()
    return _replica_id(body), _rank(body), _incarnation(body)


def check_shard_count(replica_id: str, shard_count: int, configured: int | None, previous: Quorum | None,
                      pending: Mapping[str, QuorumRequest], lives: Callable[[str], bool]) -> None:
    """Refuse (409) a group whose shard count is not the job's: the cross-group process groups pair shard rank s of
    every group. The job's is ``configured`` (``fthsdp lighthouse --shard-count``) when given; else the current
    quorum's while another of its members ``lives``, or else another pending request's: a value only a departed
    group held binds nobody (one forged request must not lock out every group to come)."""
    if configured is not None:
        expected, source = configured, "the job's shard_count (fthsdp lighthouse --shard-count)"
    elif previous is not None and any(rid != replica_id and lives(rid) for rid in previous.member_ids):
        expected, source = previous.shard_count, f"the current quorum {previous.quorum_id}"
    else:
        other = next((r for rid, r in pending.items() if rid != replica_id), None)
        if other is None:
            return
        expected, source = other.shard_count, f"the pending request of {other.replica_id!r}"
    if shard_count != expected:
        raise HttpError(409, f"shard_count {shard_count} of {replica_id!r} differs from shard_count {expected} of "
                             f"{source}: every replica group must use the same number of shard ranks (start it with "
                             f"{expected})")


class QuorumAnswers:
    """The encoded answers of the current quorum: a delta (``Quorum.to_delta_json``) for a requester holding one of
    the last ``KEPT_BASES`` member lists answered, the full quorum for any other.

    A full answer is O(members) bytes and every member asks each step: O(members^2) bytes a step in all. A delta
    carries what changed since the requester's quorum, nothing in the steady state but the fields of the step. Each
    (answer, base) is encoded once, compressed once when large, and the same bytes go to every requester holding
    that base.
    """

    def __init__(self) -> None:
        self._bases: OrderedDict[str, Quorum] = OrderedDict()
        self._current: Quorum | None = None
        self._store = ""
        self._encoded: dict[str, Response] = {}

    def formed(self, quorum: Quorum, store_address: str) -> None:
        """``quorum`` is the answer from now on; its rendezvous store is at ``store_address``."""
        self._current, self._store, self._encoded = quorum, store_address, {}
        self._bases[quorum.members_digest] = quorum
        self._bases.move_to_end(quorum.members_digest)
        if len(self._bases) > KEPT_BASES:
            self._bases.popitem(last=False)

    def base(self, members_digest: str) -> Quorum | None:
        """A kept quorum whose member list ``members_digest`` names (None: not one of those kept)."""
        return self._bases.get(members_digest)

    def to(self, members_digest: str) -> Response:
        """The answer for a requester holding the member list ``members_digest`` names ("": none)."""
        assert self._current is not None, "QuorumAnswers.to follows formed()"
        base = self._bases.get(members_digest)
        key = members_digest if base is not None else ""
        response = self._encoded.get(key)
        if response is None:
            answer = self._current.to_json() if base is None else self._current.to_delta_json(base)
            body = json.dumps({**answer, "store": self._store}, separators=(",", ":")).encode()
            response = Response(200, body, gzipped=gzip.compress(body, 6) if len(body) > GZIP_OVER_BYTES else None)
            self._encoded[key] = response
        return response


def probe_answer(targets: dict[str, str], why: str) -> Response:
    """The answer to a quorum request that must first probe ``targets`` (replica id -> the address its leader serves
    state on; a TCP connect to it tells whether that group's host is reachable) and ask again with the ids it could
    not reach in ``unreachable``. ``why``: for the requester's log."""
    return json_response({"probe": targets, "why": why})


def excluded_answer(replica_id: str, exclusion: Exclusion, targets: dict[str, str], now: float) -> Response:
    """The answer to a quorum request of an excluded group: no quorum (it is no candidate), why, and the peers to probe
    before it asks again (it is admitted once it reaches them all)."""
    return json_response({"excluded": {**exclusion.to_json(now), "replica_id": replica_id}, "probe": targets})


def _replica_ids(body: dict[str, object], name: str, what: str) -> tuple[str, ...]:
    """Field ``name``: a list of valid replica ids (HttpError 400 naming the field and the first invalid entry)."""
    ids = require(body, name, list, what)
    for rid in ids:
        try:
            check_replica_id(rid)
        except ValueError as e:
            raise HttpError(400, f"field {name!r} has an invalid entry: {e}") from None
    return tuple(ids)


def _replica_id(body: dict[str, object]) -> str:
    try:
        return check_replica_id(require(body, "replica_id", str, "a replica id string"))
    except ValueError as e:
        raise HttpError(400, f"field 'replica_id': {e}") from None


def _incarnation(body: dict[str, object]) -> str:
    try:
        return check_incarnation(require(body, "incarnation", str, "the incarnation id the group's leader chose"))
    except ValueError as e:
        raise HttpError(400, f"field 'incarnation': {e}") from None


def _rank(body: dict[str, object]) -> int:
    """The rank inside the replica group (0, the leader, when not sent)."""
    return require_int(body, "rank", 0) if "rank" in body else 0
