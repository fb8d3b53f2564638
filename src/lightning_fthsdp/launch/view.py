"""The launcher's console: a rich live table on a terminal, plain progress lines otherwise (CI, pipes)."""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning_fthsdp.launch.supervisor import GroupState

PLAIN_PROGRESS_EVERY_S = 5.0


class ConsoleView:
    """``update()`` after every poll; ``event()`` for an injection or a state change; ``close()`` at the end."""

    def __init__(self, replicas: int, max_steps: int | None, live: bool | None = None) -> None:
        """``max_steps``: the step the groups train to (None: not known, shown as ``?``)."""
        self.replicas, self.max_steps, self.started = replicas, max_steps, time.time()
        self._live: Any = None
        self._last_plain = 0.0
        self._events: list[str] = []
        if live if live is not None else sys.stdout.isatty():
            from rich.live import Live

            self._live = Live(refresh_per_second=4, transient=False)
            self._live.start()

    def event(self, text: str) -> None:
        line = f"t={time.time() - self.started:7.2f}s  {text}"
        self._events = [*self._events[-5:], line]
        if self._live is None:
            print(line, flush=True)

    def update(self, groups: dict[str, GroupState]) -> None:
        if self._live is not None:
            self._live.update(self.render(groups))
        elif time.time() - self._last_plain >= PLAIN_PROGRESS_EVERY_S:
            self._last_plain = time.time()
            step = max(g.step for g in groups.values())
            parts = " ".join(f"{g.replica_id}:{g.status}@{g.step}" for g in groups.values())
            print(f"t={time.time() - self.started:7.2f}s  step {step}/{self.max_steps or '?'}  {self._quorum(groups)}  "
                  f"loss {self._loss(groups)}  [{parts}]", flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()

    def _quorum(self, groups: dict[str, GroupState]) -> str:
        latest = max(groups.values(), key=lambda g: g.step)
        return f"quorum {len(latest.participants)}/{self.replicas} ({','.join(latest.participants)})"

    def _loss(self, groups: dict[str, GroupState]) -> str:
        losses = [g.loss for g in groups.values() if g.loss is not None]
        return f"{sum(losses) / len(losses):.4f}" if losses else "-"

    def render(self, groups: dict[str, GroupState]) -> Any:
        """The live view: a rich table of the groups and the last events."""
        from rich.console import Group as RichGroup
        from rich.table import Table

        step = max(g.step for g in groups.values())
        table = Table(title=f"fthsdp launch  t={time.time() - self.started:.1f}s  step {step}/{self.max_steps or '?'}  "
                            f"{self._quorum(groups)}")
        for column in ("group", "status", "step", "loss", "discarded", "catch-ups", "restarts"):
            table.add_column(column, justify="left" if column in ("group", "status") else "right")
        for g in groups.values():
            table.add_row(g.replica_id, g.status, str(g.step), f"{g.loss:.4f}" if g.loss is not None else "-",
                          str(g.discarded), str(g.catch_ups), str(g.restarts))
        return RichGroup(table, *self._events)
