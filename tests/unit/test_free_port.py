"""The rendezvous port a launcher picks for a process it starts later: free, and outside the OS's ephemeral range,
where another socket's port-0 bind or outgoing connection could take it before the process binds it."""

from __future__ import annotations

import contextlib
import socket

import pytest

from lightning_fthsdp.launch import processes
from lightning_fthsdp.launch.processes import EPHEMERAL_PORTS, LISTEN_PORTS, free_port


def test_a_picked_port_is_free_and_below_the_range_the_os_hands_out() -> None:
    low, high = map(int, EPHEMERAL_PORTS.read_text().split())
    picked = {free_port() for _ in range(20)}
    assert all(low - LISTEN_PORTS <= port < low for port in picked), (sorted(picked), low, high)
    assert len(picked) > 1  # at random: two launchers picking at once rarely meet
    port = picked.pop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "LISTEN_PORTS", 8)
    low = int(EPHEMERAL_PORTS.read_text().split()[0])
    held = []
    try:
        for port in range(low - 8, low - 1):  # every port of the range but the one just below it
            sock = socket.socket()
            held.append(sock)
            with contextlib.suppress(OSError):  # in use already: just as good
                sock.bind(("127.0.0.1", port))
        picked = {free_port() for _ in range(10)}
        assert all(port == low - 1 or not low - 8 <= port < low for port in picked), picked
    finally:
        for sock in held:
            sock.close()
