"""The lighthouse past its capacity, with 300 simulated group leaders (``bench/bench_lighthouse.py``'s generators,
speaking the real protocol) heartbeating every 250 ms against a 1 s timeout: stopped for 2.5 timeouts, then starved
beside a busy loop on one core, it declares nobody dead, answers ``/status`` under the load and is back to its round
times once the load falls. Among those leaders, real ones (``membership.client.Heartbeat`` in processes of their own)
that crash or hang are still found: a crash at once, a hang within the timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from bench.bench_lighthouse import TOKEN, Fleet, overload

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.membership.client import Heartbeat

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TIMEOUTS = Timeouts(heartbeat_interval_ms=250, heartbeat_timeout_ms=1_000)
GROUPS, GROUP_SIZE = 300, 8


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with Fleet(GROUPS, GROUP_SIZE, 1, TIMEOUTS) as fleet:
        yield fleet


def test_an_overloaded_lighthouse_declares_nobody_dead_and_recovers_its_round_times(fleet: Fleet) -> None:
    row = overload(fleet, stall_s=2.5, starve_s=4.0, recover_within_s=30.0)
    assert row["lag_under_load"]["max_s"] > 0.1, row  # the starving was real: its timers ran late
    assert row["deaths"] == 0 and row["dead"] == 0, row
    assert row["recovered"], row


def real_leader(url: str, replica_id: str) -> None:
    """A group's leader as the strategy runs it: the real heartbeat client, until killed."""
    beat = Heartbeat(url, TOKEN, replica_id, "real", 0, GROUP_SIZE, TIMEOUTS, step=lambda: 0,
                     on_dead=lambda dead: None, on_quorum=lambda *quorum: None, on_lost=lambda reason: None)
    beat.start()
    threading.Event().wait()


def test_a_real_leaders_crash_and_hang_are_found_among_hundreds(fleet: Fleet) -> None:
    ctx = mp.get_context("spawn")
    leaders = {rid: ctx.Process(target=real_leader, args=(fleet.url, rid), daemon=True) for rid in ("hangs", "dies")}
    for leader in leaders.values():
        leader.start()
    try:
        def groups() -> dict[str, dict[str, object]]:
            return {g["replica_id"]: g for g in fleet.status()["groups"]}

        wait_for(lambda: {"hangs", "dies"} <= groups().keys(), 60, "both real leaders' first heartbeats")
        timeout_s = TIMEOUTS.heartbeat_timeout_ms / 1000
        stopped = time.monotonic()
        os.kill(leaders["hangs"].pid, signal.SIGSTOP)
        hung = wait_for(lambda: groups()["hangs"]["dead"] and groups()["hangs"], 30, "the hang found")
        hang_found_s = time.monotonic() - stopped
        killed = time.monotonic()
        leaders["dies"].kill()
        crashed = wait_for(lambda: groups()["dies"]["dead"] and groups()["dies"], 30, "the crash found")
        crash_found_s = time.monotonic() - killed
        assert hung["cause"] == "hang" and crashed["cause"] == "crash", (hung, crashed)
        # A hang is found a timeout after the last heartbeat (up to an interval before the stop; the lighthouse's check
        # runs every tenth of the timeout), a crash as its connection closes; generous upper bounds: the point is that
        # hundreds of other leaders do not delay either.
        interval_s = TIMEOUTS.heartbeat_interval_ms / 1000
        assert timeout_s - interval_s <= hang_found_s < 3 * timeout_s, hang_found_s
        assert crash_found_s < timeout_s, crash_found_s
        simulated = [g for rid, g in groups().items() if rid not in leaders]
        assert len(simulated) == GROUPS and not any(g["deaths"] for g in simulated)
    finally:
        for leader in leaders.values():
            leader.kill()
            leader.join(10)
