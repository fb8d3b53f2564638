"""A pace file a test lets go of: groups pad their steps while it exists (so the others keep training while a killed
group restarts, however long its start takes on a loaded machine), and run at full speed once it is deleted."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def paced_until(pace_file: Path, released: Callable[[], bool]) -> Iterator[None]:
    """Create ``pace_file``; a thread deletes it once ``released()`` is true (polled every 0.2 s). On the way out the
    thread ends; a test asserts ``not pace_file.exists()`` where the release must have happened."""
    pace_file.touch()
    stop = threading.Event()

    def release() -> None:
        while not stop.is_set():
            if released():
                pace_file.unlink()
                return
            stop.wait(0.2)

    thread = threading.Thread(target=release, name="pace-release", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
