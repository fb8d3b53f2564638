"""The lighthouse's answers that both sides touch, each encoder (``*_body``, the lighthouse's) next to its reader
(``read_*``, the ranks'): the heartbeat answer, the news of a quorum it carries (a group's leader relays its own
quorum answer's to the group's other ranks in the same fields), and the quorum request's answers that carry no
quorum: a probe to make first, or the group's exclusion. The quorum answer itself is ``quorum.Quorum``'s.

A reader never raises for a field missing or of the wrong type: it reads the default, as from a lighthouse that does
not send the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

# ---- the heartbeat answer and the quorum news it carries ----


def heartbeat_answer_body(epoch: int, quorum_id: int, quorum_size: int, store: str, dead: list[str],
                          deaths: dict[str, int], heartbeat_timeout_ms: int) -> bytes:
    """The heartbeat answer every group gets: encoded once until one of its fields changes. ``quorum_id`` and
    ``quorum_size``: the newest quorum's (-1 and 0: none); ``store``: the rendezvous store's address; ``dead``: the
    groups dead now; ``deaths``: how often each group that ever died was declared dead; ``heartbeat_timeout_ms``: the
    lighthouse's, the length of a rank's commit lease. A member answered the newest quorum gets ``with_quorum_rank``'s
    bytes instead."""
    return json.dumps({
        "epoch": epoch,
        "quorum_id": quorum_id,
        "quorum_size": quorum_size,
        "store": store,
        "dead": dead,
        "deaths": deaths,
        "heartbeat_timeout_ms": heartbeat_timeout_ms,
    }).encode()


def with_quorum_rank(answer: bytes, quorum_rank: int) -> bytes:
    """``answer`` (a ``heartbeat_answer_body``) with the requester's rank in the newest quorum, appended to the shared
    bytes rather than encoded again for each member."""
    return b'%s,"quorum_rank":%d}' % (answer[:-1], quorum_rank)


def quorum_news_body(quorum_id: int, quorum_rank: int, quorum_size: int, store: str) -> dict[str, object]:
    """A group leader's news of its own quorum answer, for its ranks: the heartbeat answer's quorum fields."""
    return {"quorum_id": quorum_id, "quorum_rank": quorum_rank, "quorum_size": quorum_size, "store": store}


@dataclass(frozen=True)
class QuorumNews:
    """A quorum as a heartbeat answer or a leader's news tells it to a rank."""

    quorum_id: int
    """-1: none."""
    rank: int | None
    """The rank's group's rank in the quorum; None: the news names none (its group is no member, or was not answered
    that quorum yet)."""
    size: int
    store: str
    """The rendezvous store's address ("": not told)."""


def read_quorum_news(news: Mapping[str, object]) -> QuorumNews:
    """The quorum news in a heartbeat answer or a ``quorum_news_body``."""
    return QuorumNews(quorum_id=_int(news.get("quorum_id"), -1),
                      rank=_int(news["quorum_rank"], 0) if "quorum_rank" in news else None,
                      size=_int(news.get("quorum_size"), 0), store=str(news.get("store", "")))


@dataclass(frozen=True)
class HeartbeatAnswer:
    """A heartbeat answer as one group's rank reads it."""

    epoch: int
    """-1: none."""
    dead: frozenset[str]
    deaths: int
    """How often the lighthouse declared the reader's group dead."""
    heartbeat_timeout_ms: int | None
    """The lighthouse's heartbeat timeout (None: not sent, or not a positive integer)."""
    quorum: QuorumNews


def read_heartbeat_answer(answer: Mapping[str, object], replica_id: str) -> HeartbeatAnswer:
    """``answer`` (a ``heartbeat_answer_body``, perhaps ``with_quorum_rank``) as group ``replica_id`` reads it."""
    deaths = answer.get("deaths", {})
    dead = answer.get("dead", ())
    timeout_ms = answer.get("heartbeat_timeout_ms")
    return HeartbeatAnswer(
        epoch=_int(answer.get("epoch"), -1),
        dead=frozenset(str(d) for d in dead) if isinstance(dead, list | tuple) else frozenset(),
        deaths=int(deaths.get(replica_id, 0)) if isinstance(deaths, dict) else 0,
        heartbeat_timeout_ms=timeout_ms if isinstance(timeout_ms, int) and timeout_ms > 0 else None,
        quorum=read_quorum_news(answer),
    )


# ---- a quorum request's answers without a quorum ----


def probe_answer_body(targets: Mapping[str, str], why: str) -> dict[str, object]:
    """The requester must first probe ``targets`` (replica id -> the address its leader serves state on; a TCP
    connect to it tells whether that group's host is reachable) and ask again with the ids it could not reach in
    ``unreachable``. ``why``: for the requester's log."""
    return {"probe": targets, "why": why}


def excluded_answer_body(replica_id: str, exclusion: Mapping[str, object],
                         targets: Mapping[str, str]) -> dict[str, object]:
    """The requester ``replica_id`` is excluded: no quorum (it is no candidate), why (``exclusion``: at least its
    ``reason`` and ``detail``), and the peers to probe before it asks again (it is admitted once it reaches them
    all)."""
    return {"excluded": {**exclusion, "replica_id": replica_id}, "probe": targets}


@dataclass(frozen=True)
class ProbeAnswer:
    """A quorum request's answer that carries no quorum but peers to probe: ``probe_answer_body``'s, or
    ``excluded_answer_body``'s when ``excluded`` is set."""

    targets: dict[str, str]
    why: str
    excluded: dict[str, object] | None
    """The exclusion (``reason``, ``detail``, ...); None: only a probe is asked for."""


def read_probe_answer(answer: Mapping[str, object]) -> ProbeAnswer | None:
    """The probe or exclusion ``answer`` carries; None: it carries a quorum."""
    if "excluded" not in answer and "probe" not in answer:
        return None
    excluded = dict(answer["excluded"]) if "excluded" in answer else None  # type: ignore[call-overload]
    targets = {str(k): str(v) for k, v in dict(answer["probe"]).items()}  # type: ignore[call-overload]
    return ProbeAnswer(targets, str(answer.get("why")), excluded)


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
