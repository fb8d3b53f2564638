"""Bounded failure handling of FTManager against a real lighthouse (in a thread): the budget of failed commits, errors
no retry fixes, a shutdown that is bounded and never raises, the lease that follows the lighthouse's timeout."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.manager import CommitsFailed, FTManager
from lightning_fthsdp.membership.client import Heartbeat
from tests.lighthouse_thread import LighthouseThread

FAST = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=500, collective_timeout_ms=1_000,
                quorum_timeout_ms=1_500, connect_timeout_ms=2_000, join_timeout_ms=200, max_failed_commits=3)
TOKEN = "job-secret"


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., str]]:
    """Start lighthouse threads (port 0); all are stopped after the test."""
    with contextlib.ExitStack() as stack:
        def start(**kw: Any) -> str:
            return stack.enter_context(LighthouseThread(**{"rules": QuorumRules(min_replicas=1), "token": TOKEN,
                                                           **kw}))
        yield start


@pytest.fixture
def managers() -> Iterator[list[FTManager]]:
    """Every manager a test creates is shut down after it."""
    made: list[FTManager] = []
    yield made
    for manager in made:
        manager.shutdown()


def step(manager: FTManager) -> bool:
    manager.begin_step()
    manager.sync_gradients([torch.ones(4)])
    return manager.commit()


def test_failed_commits_stop_after_the_budget_naming_the_last_cause(lighthouse: Callable[..., str],
                                                                    managers: list[FTManager]) -> None:
    """With min_replicas=2 and one group, every step ends without a quorum (504): the third raises, naming it."""
    url = lighthouse(rules=QuorumRules(min_replicas=2))
    manager = FTManager(replica_id="a", lighthouse=url, token=TOKEN, timeouts=FAST)
    managers.append(manager)
    assert not step(manager) and not step(manager)
    with pytest.raises(CommitsFailed, match=r"3 commits in a row failed \(Timeouts.max_failed_commits=3\); the last "
                                            r"cause: no quorum: lighthouse answered 504: .*min_replicas=2"):
        step(manager)


def test_a_wrong_token_fails_at_once_naming_the_fix(lighthouse: Callable[..., str],
                                                    managers: list[FTManager]) -> None:
    manager = FTManager(replica_id="a", lighthouse=lighthouse(), token="not-the-job-secret", timeouts=FAST)
    managers.append(manager)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"answered 401: .*give every group the lighthouse's token "
                                           r"\(\$FTHSDP_TOKEN"):
        step(manager)
    assert time.monotonic() - started < FAST.quorum_timeout_ms / 1000


def test_shutdown_is_bounded_and_never_raises_whatever_the_state(lighthouse: Callable[..., str]) -> None:
    """Before the first step, with a quorum request retrying an unreachable lighthouse, and twice: each bounded,
    none raises, and every thread the manager started is gone."""
    before = set(threading.enumerate())
    unstarted = FTManager(replica_id="a", lighthouse="http://127.0.0.1:1", timeouts=FAST)
    unstarted.shutdown()
    retrying = FTManager(replica_id="b", lighthouse="http://127.0.0.1:1", timeouts=FAST)
    retrying.begin_step()  # its quorum request retries for connect_timeout_ms
    started = time.monotonic()
    retrying.shutdown()
    retrying.shutdown()
    assert time.monotonic() - started < FAST.heartbeat_timeout_ms / 1000 + 1
    ours = lambda: [t for t in set(threading.enumerate()) - before if t.name.startswith("fthsdp-")  # noqa: E731
                    and t.name != "fthsdp-reaper"]  # the reaper is one per process, idle
    wait_for(lambda: not ours(), 5, "the manager's threads to end")


def test_the_lease_follows_the_lighthouses_heartbeat_timeout(lighthouse: Callable[..., str]) -> None:
    """The lighthouse declares groups dead after 300 ms, the group's own timeouts say 2 s: the lease lasts 300 ms."""
    url = lighthouse(heartbeat_timeout_ms=300)
    ours = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=2_000, collective_timeout_ms=3_000,
                    quorum_timeout_ms=4_000, connect_timeout_ms=5_000, join_timeout_ms=200)
    heartbeat = Heartbeat(url, TOKEN, "a", "inc-1", 0, 1, ours, step=lambda: 0, on_dead=lambda dead: None,
                          on_lost=lambda _: None, on_quorum=lambda *args: None)
    heartbeat.start()
    try:
        wait_for(lambda: heartbeat.lease_ms == 300, 10, "the lease to adopt the lighthouse's 300 ms")
        assert heartbeat.lease_valid(heartbeat.deaths)
    finally:
        heartbeat.leave()
