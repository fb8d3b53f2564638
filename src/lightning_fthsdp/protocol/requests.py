"""The request bodies of the lighthouse's endpoints: for each, the encoder the ranks' side sends (``*_body``) next to
the parser the lighthouse accepts it with (``parse_*``), so each field is named here only.

A parser takes the decoded JSON object and raises :class:`~lightning_fthsdp.protocol.fields.BadBody` naming the field,
the value and the fix; the lighthouse answers that 400 and changes no state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_fthsdp.protocol.fields import (
    BadBody,
    incarnation_field,
    rank_field,
    replica_id_field,
    replica_ids_field,
    require,
    require_int,
    state_server_location,
)
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest, check_replica_id

MAX_QUORUM_TIMEOUT_MS = 3_600_000
MAX_DIGEST = 64
"""Longest ``members_digest`` a quorum request may send (``Quorum.members_digest`` is 32 hex digits)."""
MAX_UNREACHABLE = 64
"""Most groups one request may report unreachable: as many as the probe targets the lighthouse hands out at most."""
MAX_STEP_S = 86_400.0
"""Largest ``compute_s`` or ``wait_s`` a report may carry (a day): a bound, not a limit a real step nears."""
MAX_CHECKPOINT_PATH = 4096
LOSS_CAUSES = ("crash", "hang")


# ---- POST /v1/heartbeat ----


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


def heartbeat_body(replica_id: str, incarnation: str, rank: int, step: int, shard_count: int, known_epoch: int,
                   wait_ms: int, lost: Mapping[int, str] | None = None, losses: int = 0) -> dict[str, object]:
    """``lost``: the ranks the group's leader has lost now, each with its cause (one of ``LOSS_CAUSES``), and
    ``losses`` how many it lost so far; None: a client without a relay, which sends neither."""
    body: dict[str, object] = {"replica_id": replica_id, "incarnation": incarnation, "rank": rank, "step": step,
                               "shard_count": shard_count, "known_epoch": known_epoch, "wait_ms": wait_ms}
    if lost is not None:
        body["losses"], body["lost"] = losses, list(lost)
        body["lost_hung"] = [lost_rank for lost_rank, cause in lost.items() if cause == "hang"]
    return body


def parse_heartbeat(body: dict[str, object]) -> HeartbeatRequest:
    replica_id = replica_id_field(body)
    step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
    known_epoch, wait_ms = require_int(body, "known_epoch", None), require_int(body, "wait_ms", 0)
    losses = require_int(body, "losses", 0) if "losses" in body else 0
    lost = require(body, "lost", list, "a list of ranks >= 1") if "lost" in body else []
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 < r < shard_count for r in lost):
        raise BadBody(f"field 'lost' must list ranks from 1 to shard_count - 1 = {shard_count - 1}, got {lost!r}")
    hung = require(body, "lost_hung", list, "a list of ranks of 'lost'") if "lost_hung" in body else []
    if not all(isinstance(r, int) and not isinstance(r, bool) and r in lost for r in hung):
        raise BadBody(f"field 'lost_hung' must list ranks of 'lost' ({lost!r}) that went silent, got {hung!r}")
    return HeartbeatRequest(replica_id, incarnation_field(body), rank_field(body), step, shard_count, known_epoch,
                            wait_ms, tuple(lost), losses, tuple(hung))


# ---- POST /v1/lost ----


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


def lost_body(replica_id: str, incarnation: str, rank: int, lost_rank: int, cause: str,
              losses: int) -> dict[str, object]:
    """``rank``: the reporting leader's own; ``lost_rank``: the rank it lost."""
    return {"replica_id": replica_id, "incarnation": incarnation, "rank": rank, "lost_rank": lost_rank, "cause": cause,
            "losses": losses}


def parse_lost(body: dict[str, object]) -> LostRequest:
    replica_id, incarnation = replica_id_field(body), incarnation_field(body)
    rank, losses = require_int(body, "lost_rank", 1), require_int(body, "losses", 1)
    cause = require(body, "cause", str, f"one of {', '.join(LOSS_CAUSES)}")
    if cause not in LOSS_CAUSES:
        raise BadBody(f"field 'cause' must be one of {', '.join(LOSS_CAUSES)}, got {cause!r}")
    return LostRequest(replica_id, incarnation, rank, cause, losses)


# ---- POST /v1/leave ----


def leave_body(replica_id: str, incarnation: str, rank: int) -> dict[str, object]:
    return {"replica_id": replica_id, "incarnation": incarnation, "rank": rank}


def parse_leave(body: dict[str, object]) -> tuple[str, int, str]:
    """``POST /v1/leave``: (replica_id, rank, incarnation) of a rank finishing."""
    return replica_id_field(body), rank_field(body), incarnation_field(body)


# ---- POST /v1/checkpoint ----


def checkpoint_body(replica_id: str, incarnation: str, step: int, path: str) -> dict[str, object]:
    return {"replica_id": replica_id, "incarnation": incarnation, "step": step, "path": path}


def parse_checkpoint(body: dict[str, object]) -> tuple[str, str, int, str]:
    """``POST /v1/checkpoint``: (replica_id, incarnation, step, path) of a complete checkpoint its writer reports."""
    replica_id, incarnation, step = replica_id_field(body), incarnation_field(body), require_int(body, "step", 0)
    path = require(body, "path", str, "the checkpoint's folder (a string)")
    if not 0 < len(path) <= MAX_CHECKPOINT_PATH or any(ord(c) < 32 for c in path):
        raise BadBody(f"field 'path' must be 1-{MAX_CHECKPOINT_PATH} printable characters, got {path[:80]!r}")
    return replica_id, incarnation, step, path


# ---- POST /v1/quorum ----


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


def quorum_body(replica_id: str, incarnation: str, step: int, shard_count: int, address: str, commit_failed: bool,
                current: Quorum | None, committed_in: int, following: bool, timeout_ms: int, *,
                caught_up: CaughtUp | None = None, unreachable: Sequence[str] | None = None,
                exchange_failed: bool = False, rendezvous_failed: bool = False,
                timing: StepTiming | None = None) -> dict[str, object]:
    """The body of a ``POST /v1/quorum`` (``parse_quorum`` says each field) without the members of ``current``, which
    go only where the lighthouse asks for them (``with_members``)."""
    body: dict[str, object] = {
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
    if caught_up is not None:
        body["caught_up"] = {"source": caught_up.source, "step": caught_up.step, "bytes": caught_up.nbytes,
                             "fetch_s": caught_up.fetch_s}
    if unreachable is not None:
        body["unreachable"] = list(unreachable)
    if exchange_failed:
        body["exchange_failed"] = True
    if rendezvous_failed:
        body["rendezvous_failed"] = True
    if timing is not None:
        body["compute_s"] = timing.compute_s
        if timing.wait_s is not None:
            body["wait_s"] = timing.wait_s
    return body


def with_members(body: dict[str, object], current: Quorum) -> dict[str, object]:
    """``body`` sent again to a lighthouse that answered it 428: with the members of the quorum held."""
    return {**body, "members": list(current.member_ids), "held_following": sorted(current.following)}


def parse_quorum(body: dict[str, object],
                 arrived_s: float) -> tuple[QuorumRequest, str, int, CaughtUp | None, StepTiming | None]:
    """``POST /v1/quorum``: the quorum request, the requester's incarnation, how long (ms) it waits for the answer,
    the catch-up it reports (optional field ``caught_up``: ``source``, ``step``, ``bytes``, ``fetch_s``) and the
    times of its last step (optional fields ``compute_s`` and ``wait_s``, see ``StepTiming``; ``wait_s`` only with
    ``compute_s``).

    Fields: ``replica_id``, ``incarnation``, ``step``, ``shard_count``, ``address``, ``commit_failed``,
    ``committed_in``, ``following``, ``timeout_ms``, ``exchange_failed`` (optional: its last cross-group collective
    failed), ``rendezvous_failed`` (optional: it could not build its quorum's cross-group group), ``unreachable``
    (optional: the probe targets it could not reach, after a probe answer, ``answers.probe_answer_body``); of the
    quorum the requester holds, ``quorum_id`` (-1: none), ``members_digest`` (optional, ``Quorum.members_digest``:
    lets the answer be a delta), ``members`` (optional, its member ids: sent only when the lighthouse answers 428
    because it needs them, then at once with the same request) and ``held_following`` (optional, with ``members``
    only: those of them following in it). The answer is the quorum (``Quorum.to_json``, or a
    delta) with ``store``, the rendezvous store's address."""
    replica_id, incarnation = replica_id_field(body), incarnation_field(body)
    step, shard_count = require_int(body, "step", 0), require_int(body, "shard_count", 1)
    address = _state_addresses(require(body, "address", str, "a string (may be empty)"))
    commit_failed = require(body, "commit_failed", bool, "true or false")
    quorum_id, timeout_ms = require_int(body, "quorum_id", -1), require_int(body, "timeout_ms", 1)
    committed_in = require_int(body, "committed_in", -1)
    following = require(body, "following", bool, "true or false")
    if timeout_ms > MAX_QUORUM_TIMEOUT_MS:
        raise BadBody(f"field 'timeout_ms' must be at most {MAX_QUORUM_TIMEOUT_MS} (one hour), got {timeout_ms}: a "
                      f"quorum request is bounded")
    members = replica_ids_field(body, "members", "a list of replica ids") if "members" in body else ()
    # Sorted and once each: holders of one quorum compare it (``quorum.adopt``).
    held_following = tuple(sorted(set(replica_ids_field(body, "held_following", "a list of replica ids")))) \
        if "held_following" in body else ()
    if not set(held_following) <= set(members):
        raise BadBody(f"field 'held_following' must name members of the quorum held (field 'members'), got "
                      f"{sorted(set(held_following) - set(members))} beyond them")
    if held_following and len(held_following) == len(set(members)):
        raise BadBody("field 'held_following' names every member of the quorum held: a quorum has a member that "
                      "contributes (send the members following in it only)")
    digest = ""
    if "members_digest" in body:
        digest = require(body, "members_digest", str, 'a string: the members digest of the quorum held ("": none)')
    if len(digest) > MAX_DIGEST:
        raise BadBody(f"field 'members_digest' must be at most {MAX_DIGEST} characters (the digest the client "
                      f"computes), got {len(digest)}")
    exchange_failed = require(body, "exchange_failed", bool, "true or false") if "exchange_failed" in body else False
    rendezvous_failed = require(body, "rendezvous_failed", bool, "true or false") \
        if "rendezvous_failed" in body else False
    unreachable = None
    if body.get("unreachable") is not None:
        unreachable = replica_ids_field(body, "unreachable", "a list of replica ids (or null: not probed)")
        if len(unreachable) > MAX_UNREACHABLE:
            raise BadBody(f"field 'unreachable' names {len(unreachable)} groups, more than {MAX_UNREACHABLE}: a group "
                          f"reports only the probe targets the lighthouse gave it")
    request = QuorumRequest(replica_id, step, shard_count, arrived_s, address, commit_failed, quorum_id,
                            members=members, held_following=held_following, members_digest=digest,
                            committed_in=committed_in,
                            following=following, unreachable=unreachable, exchange_failed=exchange_failed,
                            rendezvous_failed=rendezvous_failed)
    return request, incarnation, timeout_ms, _caught_up(body), _step_timing(body)


@functools.lru_cache(maxsize=1 << 15)
def _state_addresses(addresses: str) -> str:
    """Field ``address``: every rank's state-server address, comma separated ("": it serves none). Checked once per
    distinct value (a refused one raises, so it is never kept): a group sends the same addresses every step."""
    for entry in addresses.split(",") if addresses else ():
        if state_server_location(entry) is None:
            raise BadBody(f"field 'address' must list each rank's state server as http://HOST:PORT (comma separated, "
                          f"or empty when the group serves none), got {entry!r} in {addresses[:200]!r}")
    return addresses


def _step_timing(body: dict[str, object]) -> StepTiming | None:
    compute_s, wait_s = _seconds(body, "compute_s"), _seconds(body, "wait_s")
    if compute_s is None:
        if wait_s is not None:
            raise BadBody("field 'wait_s' needs 'compute_s' in the same request: send both times of the step, or "
                          "neither")
        return None
    return StepTiming(compute_s, wait_s)


def _seconds(body: dict[str, object], name: str) -> float | None:
    """The optional duration ``body[name]`` (absent or null: None)."""
    if body.get(name) is None:
        return None
    value = require(body, name, float | int, f"a number of seconds from 0 to {MAX_STEP_S:g} (or null)")
    if not 0 <= value <= MAX_STEP_S:
        raise BadBody(f"field {name!r} must be a number of seconds from 0 to {MAX_STEP_S:g} (one day), got {value!r}")
    return float(value)


def _caught_up(body: dict[str, object]) -> CaughtUp | None:
    if body.get("caught_up") is None:
        return None
    report = require(body, "caught_up", dict, "an object with source, step, bytes and fetch_s (or null)")
    source = require(report, "source", str, "the replica id that delivered the state")
    try:
        check_replica_id(source)
    except ValueError as e:
        raise BadBody(f"field 'caught_up.source': {e}") from None
    fetch_s = require(report, "fetch_s", float | int, "a number of seconds >= 0")
    if not 0 <= fetch_s < float("inf"):
        raise BadBody(f"field 'fetch_s' of 'caught_up' must be a number of seconds >= 0, got {fetch_s!r}")
    return CaughtUp(source, require_int(report, "step", 0), require_int(report, "bytes", 0), float(fetch_s))
