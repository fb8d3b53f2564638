"""GroupLink: the leader's words and the commit vote of one replica group, on real loopback sockets (a thread per
rank), the refusal of strangers, and a rank that breaks the group."""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lightning_fthsdp.manager.link import HELLO, GroupLink, GroupLinkError

TIMEOUTS = {"timeout_s": 3.0, "hello_timeout_s": 0.5}


class Board:
    """The group's collective for ``open``: the leader's value, read by every other rank."""

    def __init__(self) -> None:
        self._value: queue.Queue[str] = queue.Queue()
        self.address = ""

    def from_leader(self, rank: int) -> Callable[[str], str]:
        def share(value: str) -> str:
            if rank == 0:
                self.address = value
                for _ in range(8):
                    self._value.put(value)
                return value
            return self._value.get(timeout=10)
        return share


def open_group(size: int, board: Board | None = None, incarnation: str = "inc", token: str | None = "tok",
               before_members: Callable[[str], None] | None = None) -> list[GroupLink]:
    """``size`` ranks' links, rank order; ``before_members(address)`` runs once the leader listens, before the
    other ranks connect."""
    board = board or Board()
    with ThreadPoolExecutor(size) as pool:
        leader = pool.submit(GroupLink.open, board.from_leader(0), rank=0, size=size, host="127.0.0.1", token=token,
                             incarnation=incarnation, **TIMEOUTS)
        if before_members is not None:
            address = board.from_leader(1)("")
            before_members(address)
        members = [pool.submit(GroupLink.open, board.from_leader(rank), rank=rank, size=size, host="127.0.0.1",
                               token=token, incarnation=incarnation, **TIMEOUTS) for rank in range(1, size)]
        return [leader.result(timeout=10), *(m.result(timeout=10) for m in members)]


@pytest.fixture
def group() -> Iterator[list[GroupLink]]:
    links = open_group(3)
    yield links
    for link in links:
        link.close()


def on_every_rank(links: list[GroupLink], call: Callable[[GroupLink, int], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(links)) as pool:
        futures = [pool.submit(call, link, rank) for rank, link in enumerate(links)]
        return [f.result(timeout=10) for f in futures]


def test_every_rank_gets_the_leaders_words_and_the_unanimous_vote(group: list[GroupLink]) -> None:
    words = json.dumps({"quorum": list(range(5000))}).encode()  # larger than one socket read
    got = on_every_rank(group, lambda link, rank: link.broadcast(words if rank == 0 else b""))
    assert got == [words] * 3
    flags = {0: (True, True, False), 1: (True, False, False), 2: (True, True, True)}
    assert on_every_rank(group, lambda link, rank: link.vote(flags[rank])) == [(True, False, False)] * 3
    assert on_every_rank(group, lambda link, rank: link.vote((True,))) == [(True,)] * 3


def test_a_rank_that_arrives_after_the_leader_finds_its_words_waiting(group: list[GroupLink]) -> None:
    assert group[0].broadcast(b"step 7") == b"step 7"  # nobody else is listening yet: the leader does not wait
    assert group[2].broadcast(b"") == b"step 7" and group[1].broadcast(b"") == b"step 7"


def hello_frame(**hello: object) -> bytes:
    payload = json.dumps(hello).encode()
    return struct.pack(">BI", HELLO, len(payload)) + payload


@pytest.mark.parametrize("hello", [
    {"rank": 1, "incarnation": "another", "token": "tok"},
    {"rank": 1, "incarnation": "inc", "token": "forged"},
    {"rank": 3, "incarnation": "inc", "token": "tok"},
    {"rank": 0, "incarnation": "inc", "token": "tok"},
    {"incarnation": "inc", "token": "tok"},
], ids=["other incarnation", "other token", "no such rank", "the leader's rank", "no rank"])
def test_a_stranger_is_refused_and_the_group_still_connects(hello: dict[str, object]) -> None:
    strangers: list[socket.socket] = []

    def stranger(address: str) -> None:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(hello_frame(**hello))
        strangers.append(sock)

    links = open_group(3, before_members=stranger)
    try:
        assert strangers[0].recv(1) == b"", "the leader closes the stranger's connection"
        assert on_every_rank(links, lambda link, rank: link.vote((True,))) == [(True,)] * 3
    finally:
        for link in links:
            link.close()
        strangers[0].close()


def test_a_second_connection_claiming_a_connected_rank_is_refused() -> None:
    board = Board()
    with ThreadPoolExecutor(1) as pool:
        leader = pool.submit(GroupLink.open, board.from_leader(0), rank=0, size=3, host="127.0.0.1", token="tok",
                             incarnation="inc", **TIMEOUTS)
        first = GroupLink.open(board.from_leader(1), rank=1, size=3, host="127.0.0.1", token="tok",
                               incarnation="inc", **TIMEOUTS)
        host, _, port = board.address.rpartition(":")
        double = socket.create_connection((host, int(port)), timeout=5)
        double.sendall(hello_frame(rank=1, incarnation="inc", token="tok"))
        last = GroupLink.open(board.from_leader(2), rank=2, size=3, host="127.0.0.1", token="tok",
                              incarnation="inc", **TIMEOUTS)
        links = [leader.result(timeout=10), first, last]
    try:
        assert double.recv(1) == b"", "the leader closes the second claim of rank 1"
        got = on_every_rank(links, lambda link, rank: link.broadcast(b"mine" if rank == 0 else b""))
        assert got == [b"mine"] * 3
    finally:
        double.close()
        for link in links:
            link.close()


def test_a_rank_that_never_connects_fails_the_leader_naming_it() -> None:
    board = Board()
    with (pytest.raises(GroupLinkError, match=r"ranks \[2\] of this group did not connect"),
          ThreadPoolExecutor(2) as pool):
        member = pool.submit(GroupLink.open, board.from_leader(1), rank=1, size=3, host="127.0.0.1", token="tok",
                             incarnation="inc", **TIMEOUTS)
        try:
            GroupLink.open(board.from_leader(0), rank=0, size=3, host="127.0.0.1", token="tok", incarnation="inc",
                           **TIMEOUTS)
        finally:
            member.result(timeout=10).close()


def test_a_rank_gone_breaks_the_others_calls_naming_it_and_the_leader_reports_it_first(
        group: list[GroupLink]) -> None:
    reports: list[tuple[int, str, str]] = []
    group[0].on_broken = lambda rank, cause, reason: reports.append((rank, cause, reason))
    group[2].close()
    errors: list[BaseException] = []

    def vote(link: GroupLink, rank: int) -> None:
        try:
            link.vote((True,))
        except GroupLinkError as exc:
            errors.append(exc)

    on_every_rank(group[:2], vote)
    assert [(rank, cause) for rank, cause, _ in reports] == [(2, "crash")]
    said = sorted(str(e) for e in errors)
    assert len(said) == 2 and "rank 0's link broke (the connection to rank 2 failed" in said[0]
    # Rank 1 had voted and waited for the tally: the leader's broken link ended that wait at once.
    assert "rank 1's link broke (the connection to the leader failed" in said[1] and "restarts it" in said[1]
    with pytest.raises(GroupLinkError, match=r"rank 0's link is broken \(the connection to rank 2 failed"):
        group[0].broadcast(b"later")


def test_a_silent_rank_fails_the_wait_after_the_timeout_and_the_leader_reports_a_hang(
        group: list[GroupLink]) -> None:
    with pytest.raises(GroupLinkError, match=r"rank 1's link broke \(no word from the leader within the timeout"):
        group[1].broadcast(b"")
    pair = open_group(2)
    reports: list[tuple[int, str]] = []
    pair[0].on_broken = lambda rank, cause, reason: reports.append((rank, cause))
    try:
        with pytest.raises(GroupLinkError, match=r"rank 0's link broke \(the connection to rank 1 failed \(Timeout"):
            pair[0].vote((True,))
        assert reports == [(1, "hang")]
    finally:
        pair[1].close()


def test_ranks_making_different_calls_raise_instead_of_reading_each_others_words(group: list[GroupLink]) -> None:
    errors: list[BaseException] = []

    def member_votes() -> None:
        try:
            group[1].vote((True,))
        except GroupLinkError as exc:
            errors.append(exc)

    thread = threading.Thread(target=member_votes)
    thread.start()
    group[0].broadcast(b"words")  # the leader broadcasts while rank 1 votes
    thread.join(timeout=10)
    assert errors and "the leader sent a frame of kind 2 where kind 4 was due" in str(errors[0])
    with pytest.raises(GroupLinkError, match=r"rank 1's link is broken"):
        group[1].vote((True,))  # no stray frame is ever read as a later call's


@pytest.mark.timeout(60)
def test_a_silent_stranger_holds_up_no_rank_and_a_parser_bomb_is_refused() -> None:
    """Hellos are read side by side: a stranger that connects first and says nothing does not keep the ranks out
    for its hello timeout (here longer than the test may run), nor does one whose hello nests past the parser."""
    strangers: list[socket.socket] = []

    def strangers_first(address: str) -> None:
        host, _, port = address.rpartition(":")
        silent = socket.create_connection((host, int(port)), timeout=5)
        bomb = socket.create_connection((host, int(port)), timeout=5)
        payload = b"[" * 4000
        bomb.sendall(struct.pack(">BI", HELLO, len(payload)) + payload)
        strangers.extend((silent, bomb))

    board = Board()
    timeouts = {"timeout_s": 30.0, "hello_timeout_s": 600.0}
    with ThreadPoolExecutor(3) as pool:
        leader = pool.submit(GroupLink.open, board.from_leader(0), rank=0, size=3, host="127.0.0.1", token="tok",
                             incarnation="inc", **timeouts)
        strangers_first(board.from_leader(1)(""))
        members = [pool.submit(GroupLink.open, board.from_leader(rank), rank=rank, size=3, host="127.0.0.1",
                               token="tok", incarnation="inc", **timeouts) for rank in (1, 2)]
        links = [leader.result(timeout=30), *(m.result(timeout=30) for m in members)]
    try:
        assert [s.recv(1) for s in strangers] == [b"", b""], "both strangers' connections are closed"
        assert on_every_rank(links, lambda link, rank: link.vote((True,))) == [(True,)] * 3
    finally:
        for sock in strangers:
            sock.close()
        for link in links:
            link.close()
