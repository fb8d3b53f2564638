"""The lighthouse's accept loop: bounded work per event-loop turn, outsiders within ``admission``'s caps, and
accept errors counted in one log line per interval.

Why not ``loop.create_server``: it accepts up to its backlog (1,024) connections in one turn and holds each one's
descriptor until a task of its own makes the transport, so a flood of connects takes a thousand descriptors before
the lighthouse can refuse any; and when the process is out of descriptors it logs a traceback for every failed accept
(77 MB in 45 s under a flood). Here each connection is counted as it is accepted (at a cap, the oldest outsider
connection is closed to make room: one past the grace, or young and silent; with none such among the oldest,
accepting waits), at most ``ACCEPT_BATCH`` a turn, and only after the turn's ready connections (the groups') were
read; out of descriptors, it closes the oldest outsider connection and tries again shortly.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
import time
from collections.abc import Callable

from lightning_fthsdp.lighthouse.admission import Admission, Tally
from lightning_fthsdp.lighthouse.http import Connection

log = logging.getLogger("fthsdp.lighthouse")

ACCEPT_BATCH = 16
"""Connections accepted per event-loop turn."""
ACCEPT_RETRY_S = 0.05
"""After an accept failed for want of descriptors (or memory), or while outsiders fill the total cap within their
grace: how long before the next try."""
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Listener:
    """Accepts on ``sock`` (listening, owned from here on) and hands each admitted connection to a ``factory()``
    protocol; ``admission`` decides which (see ``lighthouse.admission``). ``close()`` stops it and closes ``sock``."""

    def __init__(self, sock: socket.socket, factory: Callable[[], Connection], admission: Admission) -> None:
        self._sock, self._factory, self._admission = sock, factory, admission
        sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._scheduled: asyncio.Handle | None = None
        self._making: set[asyncio.Task[object]] = set()  # transports being made, held against collection
        self._errors = Tally()
        self._closed = False
        self._loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._scheduled is not None:
            self._scheduled.cancel()
        for task in self._making:
            task.cancel()
        self._sock.close()

    def _readable(self) -> None:
        # Accept after the turn's other ready callbacks (the groups' reads): new connections wait, groups do not.
        self._loop.remove_reader(self._fd)
        self._scheduled = self._loop.call_soon(self._accept)

    def _accept(self) -> None:
        self._scheduled = None
        for _ in range(ACCEPT_BATCH):
            if wait_s := self._admission.room(time.monotonic()):
                # At the total cap with no outsider to close for a newer one: the rest wait in the kernel's backlog.
                # Polled, since an outsider authenticating or closing also makes room.
                self._scheduled = self._loop.call_later(min(wait_s, ACCEPT_RETRY_S), self._accept)
                return
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as e:
                self._failed(e)
                if e.errno in _OUT_OF_RESOURCES:
                    # Free a descriptor for the next try (a group may be waiting behind the flood), and wait a bit:
                    # the listening socket stays readable, trying again at once would spin.
                    self._admission.evict_oldest()
                    self._scheduled = self._loop.call_later(ACCEPT_RETRY_S, self._accept)
                    return
                break
            self._take(conn, str(address[0]) if isinstance(address, tuple) else "")
        self._loop.add_reader(self._fd, self._readable)

    def _take(self, sock: socket.socket, source: str) -> None:
        sock.setblocking(False)
        protocol = self._factory()
        self._admission.add(protocol, source)
        task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: protocol, sock))
        self._making.add(task)
        task.add_done_callback(functools.partial(self._made, protocol, sock))

    def _made(self, protocol: Connection, sock: socket.socket, task: asyncio.Task[object]) -> None:
        self._making.discard(task)
        error = None if task.cancelled() else task.exception()
        if task.cancelled() or error is not None:
            # No transport: the protocol never opened, so it is closed here (its owner and the admission forget it).
            sock.close()
            protocol.connection_lost(error)  # type: ignore[arg-type]

    def _failed(self, error: OSError) -> None:
        if count := self._errors.due():
            log.error("lighthouse: accept() failed %d time(s) since the last such line (%s, %s); %d connections "
                      "without the token held (caps %d, %d per address): if the job's groups need more descriptors, "
                      "raise the open-files limit (ulimit -Hn)", count, errno.errorcode.get(error.errno or 0, "?"),
                      os.strerror(error.errno or 0), self._admission.outsiders, self._admission.limits.total,
                      self._admission.limits.per_source)
