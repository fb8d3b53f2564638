"""Where retired cross-group process groups are destroyed: off the step's thread."""

from __future__ import annotations

import queue
import threading


class Reaper:
    """Destroys retired process groups on one thread per process. Destroying a gloo group joins its threads (the GIL
    is released), time a membership change must not add to the step; and the thread exists before it is needed:
    under load a newly started thread can take as long to get scheduled."""

    def __init__(self) -> None:
        self._doomed: queue.Queue[list[object]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fthsdp-reaper", daemon=True)
                self._thread.start()

    def destroy(self, doomed: list[object]) -> None:
        """Drop the last references to ``doomed`` (process groups, or what holds them) on the reaper thread."""
        self.start()
        with self._idle:
            self._pending += 1
        self._doomed.put(doomed)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything handed over so far is destroyed; whether it was."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            doomed = self._doomed.get()
            doomed.clear()  # the last references: the groups are destroyed here
            del doomed
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()



REAPER = Reaper()
"""The process's one reaper."""
