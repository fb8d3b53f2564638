"""QuorumRequester: the leader's quorum request on its thread, against a stand-in client (no lighthouse)."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, cast

import pytest

from lightning_fthsdp.config import log
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.request import QuorumRequester, QuorumUnavailable
from lightning_fthsdp.membership.client import Excluded, ProbeRequested, QuorumClient
from lightning_fthsdp.membership.connection import LighthouseUnavailable
from lightning_fthsdp.protocol.quorum import Member, Quorum

TIMEOUTS = Timeouts(heartbeat_interval_ms=10, heartbeat_timeout_ms=50, collective_timeout_ms=100,
                    quorum_timeout_ms=200, connect_timeout_ms=300, join_timeout_ms=100)
QUORUM = Quorum(7, (Member("a", 4, "a0"), Member("b", 4, "b0"), Member("c", 2, "c0")), 4, 1,
                catch_up_from={"c": "a"}, following=frozenset({"b"}))


class Client:
    """Answers each request with the next of ``answers`` (an exception is raised); records what was asked."""

    def __init__(self, *answers: tuple[Quorum, str] | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[Any, ...]] = []
        self.timings: list[Any] = []  # the step times each request reported (lighthouse.stragglers)
        self.announced: list[tuple[Quorum, str]] = []  # what the requester told the group of
        self.closed = False
        self.release = threading.Event()
        self.release.set()

    def request(self, *args: Any, timing: Any = None, exchange_failed: bool = False,
                rendezvous_failed: bool = False) -> tuple[Quorum, str]:
        self.release.wait(10)
        self.asked.append(args)
        self.timings.append(timing)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        self.closed = True


def requester(client: Client, replica_id: str = "a", step: int = 4) -> tuple[QuorumRequester, list[int]]:
    served: list[int] = []
    qlog = log.ReplicaLogger(log.QUORUM, replica_id, 0, lambda: step)
    return QuorumRequester(cast(QuorumClient, client), replica_id, 2, ["h:1", "h:2"], TIMEOUTS, qlog,
                           step=lambda: step, serve=served.append,
                           announce=lambda quorum, store: client.announced.append((quorum, store))), served


def test_the_answer_is_the_clients_and_the_request_says_what_the_group_holds() -> None:
    client = Client((QUORUM, "store:1"))
    request, _ = requester(client)
    try:
        request.start(4, True, None, "", 3, True)
        assert request.answer() == (QUORUM, "store:1")
        assert client.announced == [(QUORUM, "store:1")]  # the group learns each answer as it comes
        assert client.asked == [("a", 4, 2, "h:1,h:2", True, None, 3, True, None, None)]
        caught_up = {"source": "b", "step": 3, "bytes": 10, "fetch_s": 0.5}  # reported with the next request
        assert request.start(5, False, QUORUM, "store:1", 7, False, caught_up)
        assert request.answer() == (QUORUM, "store:1")
        assert client.asked[-1] == ("a", 5, 2, "h:1,h:2", False, QUORUM, 7, False, caught_up, None)
    finally:
        request.close()
    assert client.closed


def test_a_request_in_flight_is_not_sent_twice() -> None:
    client = Client((QUORUM, "store:1"))
    client.release.clear()
    request, _ = requester(client)
    try:
        request.start(4, False, None, "", -1, False)
        request.start(4, False, None, "", -1, False)
        client.release.set()
        request.answer()
        assert len(client.asked) == 1
    finally:
        request.close()


def test_an_answer_naming_us_a_source_starts_the_snapshot_of_that_step() -> None:
    client = Client((QUORUM, "store:1"))
    request, served = requester(client)
    try:
        request.start(4, False, None, "", -1, False)
        request.answer()
        assert served == [4]
    finally:
        request.close()


@pytest.mark.parametrize(("replica_id", "step_now"), [("b", 4), ("a", 5)], ids=["not a source", "step moved on"])
def test_no_snapshot_for_a_group_no_source_or_past_that_step(replica_id: str, step_now: int) -> None:
    request, served = requester(Client((QUORUM, "store:1")), replica_id, step=step_now)
    try:
        request.start(4, False, None, "", -1, False)
        request.answer()
        assert served == []
    finally:
        request.close()


def test_an_unreachable_lighthouse_keeps_the_quorum_of_a_group_that_committed_its_last_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """Kept as a plain quorum at the new step: last step's recovery assignments are not replayed, who was following
    still is; the lighthouse's return is logged once it answers again."""
    client = Client(LighthouseUnavailable("refused", refused=True), (QUORUM, "store:2"))
    request, _ = requester(client)
    try:
        with caplog.at_level(logging.INFO, log.QUORUM):
            request.start(5, False, QUORUM, "store:1", 7, False)
            kept, store = request.answer()
            assert store == "store:1"
            assert (kept.quorum_id, kept.max_step, kept.member_ids) == (7, 5, ("a", "b", "c"))
            assert all(m.step == 5 for m in kept.members)
            assert dict(kept.catch_up_from) == {} and kept.following == {"b"}
            assert client.announced == []  # a quorum kept is no news from the lighthouse
            request.start(6, False, kept, store, 7, False)
            assert request.answer() == (QUORUM, "store:2")
            assert client.announced == [(QUORUM, "store:2")]
        assert "keeping quorum 7" in caplog.text and "lighthouse is back" in caplog.text
    finally:
        request.close()


@pytest.mark.parametrize(("step", "commit_failed", "current"),
                         [(5, True, QUORUM), (6, False, QUORUM), (5, False, None)],
                         ids=["commit failed", "behind its quorum", "no quorum"])
def test_an_unreachable_lighthouse_ends_in_quorum_unavailable_without_a_quorum_to_keep(
        step: int, commit_failed: bool, current: Quorum | None) -> None:
    request, _ = requester(Client(LighthouseUnavailable("refused", refused=True)))
    try:
        request.start(step, commit_failed, current, "store:1", 7, False)
        with pytest.raises(QuorumUnavailable, match="connect_timeout_ms=300"):
            request.answer()
    finally:
        request.close()


def test_a_probe_the_lighthouse_asks_for_goes_with_the_same_request_sent_again() -> None:
    """After a failed exchange the lighthouse asks for a probe of the members: the requester probes them (a closed
    port is a host that answered; a silent one is not reached) and asks again with what it could not reach."""
    with socket.create_server(("127.0.0.1", 0)) as up:
        targets = {"b": f"http://127.0.0.1:{up.getsockname()[1]}", "c": "no address"}
        client = Client(ProbeRequested(targets, "the exchange failed"), (QUORUM, "store:1"))
        request, _ = requester(client)
        try:
            request.start(4, True, QUORUM, "store:1", 3, False)
            assert request.answer() == (QUORUM, "store:1")
        finally:
            request.close()
    assert [asked[-1] for asked in client.asked] == [None, ["c"]]


def test_an_excluded_group_reports_its_probe_with_its_next_request() -> None:
    with socket.create_server(("127.0.0.1", 0)) as up:
        targets = {"b": f"http://127.0.0.1:{up.getsockname()[1]}"}
        client = Client(Excluded({"reason": "partition", "detail": "cannot exchange with b"}, targets),
                        (QUORUM, "store:1"))
        request, _ = requester(client)
        try:
            request.start(4, True, None, "", 3, False)
            with pytest.raises(Excluded, match="keeps this group out"):
                request.answer()
            request.start(4, True, None, "", 3, False)
            assert request.answer() == (QUORUM, "store:1")
        finally:
            request.close()
    assert [asked[-1] for asked in client.asked] == [None, []]  # it reached b: the lighthouse admits it


def test_the_last_steps_times_go_with_the_next_request_once() -> None:
    client = Client((QUORUM, "store:1"))
    request, _ = requester(client)
    try:
        timing = {"compute_s": 0.3, "wait_s": 0.01}
        assert request.start(4, False, QUORUM, "store:1", 3, False, None, timing)
        request.answer()
        assert request.start(5, False, QUORUM, "store:1", 3, False)
        request.answer()
    finally:
        request.close()
    assert client.timings == [timing, None]
