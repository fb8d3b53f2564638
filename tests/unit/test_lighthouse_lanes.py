"""The lighthouse's two-lane selector (``lighthouse.lanes``): a socket just made is read in the first turn however many
of the groups' sockets are ready, each turn takes a bounded number of those, and none of them waits for ever."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
from collections.abc import Iterator

import pytest

from lightning_fthsdp.lighthouse import lanes
from lightning_fthsdp.lighthouse.lanes import FAST_EVENTS, MAIN_EVENTS, LaneSelector
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.server import Lighthouse


@pytest.fixture
def selector() -> Iterator[LaneSelector]:
    made = LaneSelector()
    yield made
    made.close()


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Connected socket pairs the test makes: (the end a selector watches, the end that writes to it)."""
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def readable(pairs: list[tuple[socket.socket, socket.socket]], count: int) -> list[socket.socket]:
    """``count`` new pairs whose watched end has a byte to read."""
    new = [socket.socketpair() for _ in range(count)]
    pairs += new
    for _, theirs in new:
        theirs.send(b"x")
    return [ours for ours, _ in new]


def test_a_new_socket_is_read_in_the_first_turn_while_every_group_is_ready(
        selector: LaneSelector, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    groups = readable(pairs, 3 * MAIN_EVENTS)
    for sock in groups:
        selector.register(sock, selectors.EVENT_READ, "group")
        selector.settle(sock.fileno())
    turns = [selector.select(0)]  # the groups' sockets were ready first
    newcomer = readable(pairs, 1)[0]
    selector.register(newcomer, selectors.EVENT_READ, "new")
    turns.append(selector.select(0))
    assert len(turns[0]) == MAIN_EVENTS and {key.data for key, _ in turns[0]} == {"group"}
    assert turns[1][0][0].fileobj is newcomer and turns[1][0][1] == selectors.EVENT_READ
    assert len(turns[1]) == 1 + MAIN_EVENTS
    # Level-triggered and taken in turn: the groups not taken yet come next, before those taken come again.
    while len({key.fd for turn in turns for key, _ in turn}) < len(groups) + 1:
        turns.append(selector.select(0))
        assert len(turns) <= 5, "a ready group's socket was passed over"


def test_the_fast_lane_takes_a_bounded_number_per_turn_too(
        selector: LaneSelector, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    for sock in readable(pairs, FAST_EVENTS + 10):
        selector.register(sock, selectors.EVENT_READ)
    assert len(selector.select(0)) == FAST_EVENTS


def test_a_settled_descriptor_stays_in_the_main_lane_when_registered_again_until_forgotten(
        selector: LaneSelector, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    """A connection that pauses its reading unregisters and registers again: it stays where it was settled; a socket
    that gets the number of one closed (``forget``) starts in the fast lane."""
    groups = readable(pairs, MAIN_EVENTS + 1)
    for sock in groups:
        selector.register(sock, selectors.EVENT_READ)
        selector.settle(sock.fileno())
    paused = groups[0]
    selector.unregister(paused)
    selector.register(paused, selectors.EVENT_READ)
    assert len(selector.select(0)) == MAIN_EVENTS  # all in the main lane still
    selector.unregister(paused)
    selector.forget(paused.fileno())
    selector.register(paused, selectors.EVENT_READ, "again")
    turn = selector.select(0)
    assert turn[0][0].data == "again"


def test_register_modify_unregister_and_the_keys(selector: LaneSelector,
                                                  pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    sock = readable(pairs, 1)[0]
    key = selector.register(sock, selectors.EVENT_READ, "r")
    assert selector.get_key(sock) == key and selector.get_key(sock.fileno()) == key and len(selector.get_map()) == 1
    with pytest.raises(KeyError):
        selector.register(sock, selectors.EVENT_READ)
    with pytest.raises(ValueError, match="invalid events"):
        selector.register(readable(pairs, 1)[0], 0)
    selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, "rw")
    assert selector.select(0) == [(selector.get_key(sock), selectors.EVENT_READ | selectors.EVENT_WRITE)]
    selector.settle(sock.fileno())
    selector.modify(sock, selectors.EVENT_WRITE, "w")
    assert selector.select(0) == [(selector.get_key(sock), selectors.EVENT_WRITE)]
    assert selector.unregister(sock).data == "w"
    with pytest.raises(KeyError):
        selector.get_key(sock)
    assert selector.select(0) == []


@pytest.mark.parametrize("settled", [False, True], ids=["fast lane", "main lane"])
def test_a_poll_with_nothing_ready_sleeps_until_either_lane_has_something(
        selector: LaneSelector, pairs: list[tuple[socket.socket, socket.socket]], settled: bool) -> None:
    ours, theirs = socket.socketpair()
    pairs.append((ours, theirs))
    selector.register(ours, selectors.EVENT_READ, "late")
    if settled:
        selector.settle(ours.fileno())
    assert selector.select(0.01) == []
    timer = threading.Timer(0.05, theirs.send, (b"x",))
    timer.start()
    try:
        assert [key.data for key, _ in selector.select(30)] == ["late"]
    finally:
        timer.join()


def test_the_lighthouse_settles_a_connection_once_its_token_passed_and_forgets_it_when_closed() -> None:
    async def run() -> tuple[bool, bool, bool]:
        lighthouse = Lighthouse(host="127.0.0.1", port=0, rules=QuorumRules(min_replicas=1), startup_grace_ms=0,
                                token="lane-t0ken")
        await lighthouse.start()
        selector = lanes._BY_LOOP[asyncio.get_running_loop()]
        try:
            host, port = lighthouse.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            await asyncio.sleep(0.05)
            before = bool(selector._settled)
            writer.write(b"GET /status HTTP/1.1\r\nHost: lh\r\nAuthorization: Bearer lane-t0ken\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            after = bool(selector._settled)
            writer.close()
            await writer.wait_closed()
            for _ in range(100):
                if not selector._settled:
                    break
                await asyncio.sleep(0.01)
            return before, after, bool(selector._settled)
        finally:
            await lighthouse.stop()

    with asyncio.Runner(loop_factory=lanes.new_event_loop) as runner:
        assert runner.run(run()) == (False, True, False)
