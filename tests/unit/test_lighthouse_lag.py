"""A lighthouse that runs behind declares nobody dead for it, and a storm of deaths or revivals does not wake every
held heartbeat once per event: ``lighthouse.lag`` and the server's use of it, in-process (the event loop is stalled
on purpose, and a connection's writes are collected without sockets)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.lag import Lag
from lightning_fthsdp.lighthouse.news import REVIVAL_NEWS_S
from lightning_fthsdp.lighthouse.server import WAKE_WINDOW_S, Lighthouse
from tests.memory_transport import MemoryTransport
from tests.unit.test_lighthouse import hb


def test_lag_keeps_the_largest_of_its_window_and_counts_a_timer_overdue_now() -> None:
    lag = Lag(window_s=1.0, behind_s=0.3)
    lag.expect(10.0)
    assert lag.largest_s(9.0) == 0.0 and not lag.behind(9.0) and lag.grace_s(9.0) == 0.0
    lag.ran(10.0, 10.5)  # half a second late: behind
    lag.ran(10.6, 10.7)
    lag.expect(10.8)
    assert lag.last_s == pytest.approx(0.1) and lag.largest_s(10.7) == pytest.approx(0.5) and lag.behind(10.7)
    assert lag.grace_s(10.7) == pytest.approx(1.0)
    assert lag.largest_s(11.45) == pytest.approx(0.65) and lag.behind(11.45)  # overdue by 0.65 s: a stall under way
    lag.ran(10.8, 11.45)
    lag.expect(11.5)
    assert lag.largest_s(12.0) == pytest.approx(0.65) and lag.behind(12.0)
    lag.ran(11.5, 11.51)
    lag.expect(12.5)
    assert lag.largest_s(12.5) == pytest.approx(0.01) and not lag.behind(12.5)  # a window later: caught up
    assert lag.to_json(12.5) == {"last_s": 0.01, "max_s": 0.01, "behind": False, "grace_s": 0.02}
    with pytest.raises(ValueError, match="Lag window_s and behind_s must be > 0"):
        Lag(window_s=0.0, behind_s=0.1)


class Leader:
    """One group's leader on an in-process connection: heartbeat long-polls, each answered one counted."""

    def __init__(self, lighthouse: Lighthouse, rid: str) -> None:
        self.rid, self.transport = rid, MemoryTransport()
        self.connection: Connection = lighthouse._connect()
        self.connection.connection_made(self.transport)
        self.requests = 0

    def beat(self, epoch: int, wait_ms: int = 60_000) -> None:
        self.requests += 1
        body = json.dumps(hb(self.rid, epoch, wait_ms=wait_ms)).encode()
        self.connection.data_received(b"POST /v1/heartbeat HTTP/1.1\r\nX-Request-Id: %d\r\nContent-Length: %d\r\n\r\n%s"
                                      % (self.requests, len(body), body))

    def answers(self) -> list[dict[str, Any]]:
        parts = bytes(self.transport.written).split(b"HTTP/1.1 200")[1:]
        return [json.loads(part[part.index(b"\r\n\r\n") + 4:]) for part in parts]


async def _started(heartbeat_timeout_ms: int, *rids: str) -> tuple[Lighthouse, dict[str, Leader]]:
    lighthouse = Lighthouse(host="127.0.0.1", port=0, startup_grace_ms=0, heartbeat_timeout_ms=heartbeat_timeout_ms)
    await lighthouse.start()
    leaders = {rid: Leader(lighthouse, rid) for rid in rids}
    for leader in leaders.values():
        leader.beat(-1, wait_ms=0)  # answered at once: the epoch it learns is what it holds at next
    await asyncio.sleep(0)
    for leader in leaders.values():
        leader.beat(leader.answers()[-1]["epoch"])
    return lighthouse, leaders


def test_a_stalled_lighthouse_declares_nobody_dead_and_finds_the_really_silent_group_after_catching_up() -> None:
    """The loop stalls for 2.5 heartbeat timeouts (the process stopped, say). A group whose client gave up and
    closed its connection meanwhile is no crash; the groups that beat again live; the one that stays silent is
    declared hung once the lighthouse has kept up for a timeout."""
    async def run() -> None:
        lighthouse, leaders = await _started(400, "a", "b", "c")
        time.sleep(1.0)  # the stall: nothing of the lighthouse runs
        stalled_at = time.monotonic()
        leaders["c"].connection.connection_lost(None)  # its client timed out and went: read as the loop resumes
        assert lighthouse.status()["lighthouse_lag"]["behind"]
        await asyncio.sleep(0.05)
        assert not any(g["dead"] for g in lighthouse.status()["groups"]), lighthouse.status()["groups"]
        while time.monotonic() - stalled_at < 4.0 and not lighthouse.status()["groups"][2]["dead"]:
            for rid in ("a", "b"):
                leaders[rid].beat(-1, wait_ms=0)
            await asyncio.sleep(0.1)
        groups = {g["replica_id"]: g for g in lighthouse.status()["groups"]}
        await lighthouse.stop()
        assert not groups["a"]["dead"] and not groups["b"]["dead"], groups
        assert groups["c"]["dead"] and groups["c"]["cause"] == "hang", groups["c"]
        assert lighthouse._lag.to_json(time.monotonic())["max_s"] < 0.5  # caught up when it declared c

    asyncio.run(run())


def test_a_crash_while_the_lighthouse_keeps_up_is_declared_at_once() -> None:
    async def run() -> None:
        lighthouse, leaders = await _started(400, "a", "b")
        leaders["b"].connection.connection_lost(None)
        groups = {g["replica_id"]: g for g in lighthouse.status()["groups"]}
        await lighthouse.stop()
        assert groups["b"]["dead"] and groups["b"]["cause"] == "crash" and not groups["a"]["dead"], groups

    asyncio.run(run())


def test_deaths_within_the_wake_window_wake_each_held_heartbeat_once_and_revivals_wake_none() -> None:
    async def run() -> None:
        lighthouse, leaders = await _started(60_000, "a", "b", "c", "d")
        before = {rid: len(leader.answers()) for rid, leader in leaders.items()}
        lighthouse._liveness.declare_dead("c", "crash", "test", time.monotonic(), None)  # told at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        woken = leaders["a"].answers()[-1]
        assert len(leaders["a"].answers()) == before["a"] + 1 and woken["dead"] == ["c"], woken
        for rid in ("a", "b"):
            leaders[rid].beat(woken["epoch"])
        # Within the window of c's wake: one more, after it ends.
        lighthouse._liveness.declare_dead("d", "crash", "test", time.monotonic(), None)
        await asyncio.sleep(0)
        assert len(leaders["a"].answers()) == before["a"] + 1
        await asyncio.sleep(WAKE_WINDOW_S * 2)
        assert [len(leaders[rid].answers()) - before[rid] for rid in ("a", "b")] == [2, 2]
        assert leaders["b"].answers()[-1]["dead"] == ["c", "d"]
        epoch = leaders["b"].answers()[-1]["epoch"]
        for rid in ("a", "b"):
            leaders[rid].beat(epoch)
        for rid in ("c", "d"):  # revivals: no new epoch, no wake; the answers' dead list follows within a moment
            leaders[rid].beat(-1, wait_ms=0)
        await asyncio.sleep(REVIVAL_NEWS_S * 2)
        assert [len(leaders[rid].answers()) - before[rid] for rid in ("a", "b")] == [2, 2]
        assert lighthouse.status()["epoch"] == epoch and not any(g["dead"] for g in lighthouse.status()["groups"])
        leaders["c"].beat(-1, wait_ms=0)
        await asyncio.sleep(0)
        assert leaders["c"].answers()[-1]["dead"] == []
        await lighthouse.stop()

    asyncio.run(run())


def test_a_join_deadline_that_passes_between_a_decision_and_its_timer_still_wakes_the_next_decision() -> None:
    """A decision just before the oldest request's join deadline answers nobody; by the time it arms the join timer
    the deadline has passed (a busy loop, a slow turn). The timer is armed against the decision's own ``now``, so it
    fires at once and the next decision answers: without it nothing would decide until another request came."""
    from lightning_fthsdp.lighthouse.quorum import QuorumRules
    from tests.unit.test_lighthouse import qr

    async def run() -> None:
        lighthouse = Lighthouse(host="127.0.0.1", port=0, startup_grace_ms=0, heartbeat_timeout_ms=60_000,
                                rules=QuorumRules(min_replicas=2, join_timeout_ms=200))
        await lighthouse.start()
        leaders = {rid: Leader(lighthouse, rid) for rid in ("a", "b", "c")}
        for leader in leaders.values():
            leader.beat(-1, wait_ms=0)
        for rid in ("a", "b"):  # c lives and does not ask: the rules wait for the join timeout
            body = json.dumps(qr(rid, 0)).encode()
            leaders[rid].connection.data_received(
                b"POST /v1/quorum HTTP/1.1\r\nX-Request-Id: 9\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        asked = time.monotonic()
        rounds = lighthouse._rounds
        rounds._join_timer.cancel()  # the timer armed at the arrivals stands for the decision's own
        rounds._join_timer = None
        await asyncio.sleep(0.3)  # the deadline passes
        rounds._arm_join_timer(asked + 0.1)  # a decision's now before the deadline
        for _ in range(20):
            await asyncio.sleep(0.01)
        answered = [leaders[rid].answers()[-1] for rid in ("a", "b")]
        await lighthouse.stop()
        for answer in answered:
            assert [m["replica_id"] for m in answer["members"]] == ["a", "b"], answer

    asyncio.run(run())
