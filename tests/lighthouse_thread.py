"""A lighthouse in a thread of the test process, for tests that talk to it over real loopback HTTP."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lightning_fthsdp.lighthouse.server import Lighthouse


class LighthouseThread:
    """Runs a :class:`Lighthouse` on its own event loop in a daemon thread; ``with`` yields its url.

    Entering raises what ``start()`` raised; leaving stops it (bounded: 10 s).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.lighthouse = Lighthouse(**kwargs)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="lighthouse", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("LighthouseThread: the lighthouse did not start within 60 s")
        if self._error is not None:
            raise self._error
        return self.lighthouse.url

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            await self.lighthouse.start()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.lighthouse.stop()
