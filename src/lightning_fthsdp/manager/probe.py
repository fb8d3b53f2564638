"""Which peer groups this host can reach: the probe the lighthouse asks for after an exchange failed while every
member lived, and before an excluded group is admitted again (``lighthouse.exclusions``)."""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

MAX_PARALLEL = 64
"""Probes in flight at once: a probe is a TCP connect, mostly waiting."""


def unreachable(targets: Mapping[str, str], timeout_s: float) -> list[str]:
    """The ids of ``targets`` (replica id -> ``http://HOST:PORT``, where its leader serves state) that no TCP connect
    reached within ``timeout_s``, probed in parallel. A refused connect counts as reached: the peer's host answered
    (its process may be gone, which the lighthouse learns from its heartbeats, not from us). A connect needs packets
    both ways, so a one-way cut shows from either side."""
    if not targets:
        return []
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(targets)), thread_name_prefix="fthsdp-probe") as pool:
        reached = dict(zip(targets, pool.map(lambda address: _reaches(address, timeout_s), targets.values()),
                           strict=True))
    return sorted(rid for rid, ok in reached.items() if not ok)


def _reaches(address: str, timeout_s: float) -> bool:
    parts = urllib.parse.urlsplit(address if "//" in address else f"//{address}")
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
