"""The lighthouse's event loop on asyncio: a selector with two lanes, so a connection just made (a ``/status`` call, an
operator's browser, a group that reconnects) is read within a few event-loop turns however far behind the groups are.

Why: asyncio's loop runs the callback of every socket ready when it polls, in one turn. When the lighthouse falls
behind (starved of CPU beside a busy process, or stopped and resumed), every group's socket is ready at once, and one
turn reads thousands of requests: tens of seconds of wall time at a few percent of a core. A connection made meanwhile
waits for that turn, and epoll hands out its ready list in order, so it then waits for every socket ready before it.

Here every socket starts in the fast lane: the listening socket, and each connection until its first request passed
the token check (``settle`` then moves it to the main lane). A turn takes what is ready in the fast lane, at most
``FAST_EVENTS``, and at most ``MAIN_EVENTS`` of the main lane; epoll gives the main lane's others to the next turns,
oldest first, so none waits for ever. The fast lane's epoll is itself watched by the main one: a poll with nothing
ready sleeps on one descriptor for both.

uvloop (``--event-loop uvloop``) has no such lanes: libuv's loop also runs every ready callback in one turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import selectors
import weakref
from collections.abc import Mapping
from typing import Any

FAST_EVENTS = 32
"""Ready sockets of the fast lane (listening socket, connections not yet past the token check) taken per turn: as
many as of the main lane, so a flood of outsiders' connections (capped by ``lighthouse.admission``) takes at most half
of a turn."""
MAIN_EVENTS = 32
"""Ready sockets of the main lane (the groups' connections) taken per turn: a turn's work stays bounded when all of
them are ready at once. Fewer makes a starved lighthouse's new connection wait less (``bench_lighthouse.py
--overload``, docs/timeouts.md) at the cost of a poll per that many sockets."""

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LaneSelector] = weakref.WeakKeyDictionary()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """An asyncio event loop on a ``LaneSelector`` (the lighthouse's ``--event-loop asyncio``)."""
    selector = LaneSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _BY_LOOP[loop] = selector
    return loop


def settle(fd: int) -> None:
    """The connection on ``fd`` passed the token check: from now on it is read in the main lane. Nothing where the
    running loop is not one of ``new_event_loop``'s."""
    selector = _BY_LOOP.get(asyncio.get_running_loop())
    if selector is not None:
        selector.settle(fd)


def forget(fd: int) -> None:
    """The connection on ``fd`` closes: the next socket given that number starts in the fast lane again."""
    selector = _BY_LOOP.get(asyncio.get_running_loop())
    if selector is not None:
        selector.forget(fd)


def _fd_of(fileobj: Any) -> int:
    fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
    if not isinstance(fd, int) or fd < 0:
        raise ValueError(f"invalid file descriptor {fd!r} of {fileobj!r}")
    return fd


def _mask(events: int) -> int:
    return (select.EPOLLIN if events & _READ else 0) | (select.EPOLLOUT if events & _WRITE else 0)


class _Keys(Mapping[Any, selectors.SelectorKey]):
    """``get_map()``: the registered file objects' keys, read-only."""

    def __init__(self, keys: dict[int, selectors.SelectorKey]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, fileobj: Any) -> selectors.SelectorKey:
        try:
            return self._keys[_fd_of(fileobj)]
        except (ValueError, AttributeError):
            raise KeyError(f"{fileobj!r} is not registered") from None

    def __iter__(self) -> Any:
        return iter(self._keys)


class LaneSelector(selectors.BaseSelector):
    """A level-triggered epoll selector in two lanes (see the module docstring)."""

    def __init__(self) -> None:
        self._fast, self._main = select.epoll(), select.epoll()
        self._fast_fd = self._fast.fileno()
        self._main.register(self._fast_fd, select.EPOLLIN)
        self._keys: dict[int, selectors.SelectorKey] = {}
        self._settled: set[int] = set()  # descriptors of the main lane, registered now or not (see settle)
        self._map = _Keys(self._keys)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        if not events or events & ~(_READ | _WRITE):
            raise ValueError(f"invalid events {events!r}: EVENT_READ, EVENT_WRITE or both")
        fd = _fd_of(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (descriptor {fd}) is already registered")
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._lane(fd).register(fd, _mask(events))
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = self._map[fileobj]
        del self._keys[key.fd]
        # Closed before it was unregistered: the kernel dropped it from the epoll already.
        with contextlib.suppress(OSError):
            self._lane(key.fd).unregister(key.fd)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = self._map[fileobj]
        if events != key.events:
            self._lane(key.fd).modify(key.fd, _mask(events))
        key = self._keys[key.fd] = key._replace(events=events, data=data)
        return key

    def settle(self, fd: int) -> None:
        """Move ``fd`` to the main lane (where it stays while registered again and again, until ``forget``)."""
        if fd in self._settled:
            return
        self._settled.add(fd)
        key = self._keys.get(fd)
        if key is not None:
            self._fast.unregister(fd)
            self._main.register(fd, _mask(key.events))

    def forget(self, fd: int) -> None:
        self._settled.discard(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Rounded up to the millisecond epoll counts in: rounded down, a timer due in 0.4 ms would be polled for
        # again and again without sleeping.
        wait = -1 if timeout is None else 0 if timeout <= 0 else math.ceil(timeout * 1e3) * 1e-3
        ready = self._fast.poll(0, FAST_EVENTS)
        main = self._main.poll(0 if ready else wait, MAIN_EVENTS)
        if not ready and any(fd == self._fast_fd for fd, _ in main):
            ready = self._fast.poll(0, FAST_EVENTS)  # woken by the fast lane
        chosen = []
        for fd, event in ready + main:
            key = self._keys.get(fd)
            if key is None:
                continue  # the fast lane's own descriptor, or one unregistered since
            events = (_WRITE if event & ~select.EPOLLIN else 0) | (_READ if event & ~select.EPOLLOUT else 0)
            if events & key.events:
                chosen.append((key, events & key.events))
        return chosen

    def close(self) -> None:
        self._keys.clear()
        self._settled.clear()
        self._fast.close()
        self._main.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map

    def _lane(self, fd: int) -> select.epoll:
        return self._main if fd in self._settled else self._fast
