"""An asyncio transport that keeps what a connection writes in memory: the lighthouse's connections driven in-process,
without sockets (the unit tests, and bench/bench_lighthouse_cpu.py timing the lighthouse's own work)."""

from __future__ import annotations

import asyncio
from typing import Any


class MemoryTransport(asyncio.Transport):
    """Collects what a connection writes; never closing, no socket behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass
