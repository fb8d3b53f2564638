"""What a soak keeps of each group and network fault while it runs: the groups' incarnations, their JSONL records read
as they grow, and the network faults struck."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_fthsdp.netcluster.faults import NetworkFault
from lightning_fthsdp.protocol.records import RecordKind, RecordReader, select


@dataclass
class Incarnation:
    spawned: float
    fault: str | None
    commits: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) of each commit."""
    catch_up_at: list[float] = field(default_factory=list)
    """Times of the commits that ended a catch-up (their gap is this group's own recovery, not a stall)."""
    stopped: list[tuple[float, float]] = field(default_factory=list)
    """When it was stopped (seconds since the soak began, like every time here)."""
    imports_done: float | None = None
    ready: float | None = None
    ended: float | None = None
    end: str = ""


class Tail:
    """One group's records (every incarnation appends to the same file), read as they grow; also what
    ``testing.invariants`` reads (``records``)."""

    def __init__(self, replica_id: str, path: Path) -> None:
        self.replica_id, self.path = replica_id, path
        self.rows: list[dict[str, Any]] = []
        self._reader = RecordReader(path)

    def read(self) -> list[dict[str, Any]]:
        new = self._reader.read()
        self.rows += new
        return new

    def seal(self) -> None:
        """End a dead incarnation's last line so the next one starts a fresh one (the cut line is then skipped)."""
        if self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("ab") as file:
                file.write(b"\n")

    def records(self, event: str | None = RecordKind.COMMIT, rank: int | None = 0) -> list[dict[str, Any]]:
        return select(self.rows, event, rank)


@dataclass
class SoakGroup:
    replica_id: str
    tail: Tail
    fault_file: Path
    incarnations: list[Incarnation] = field(default_factory=list)
    pid: int = 0
    alive: bool = False
    stopped_since: float | None = None
    resolve_at: float = 0.0
    restart_at: float | None = None
    kill_at: float | None = None
    """An external kill planned for this incarnation (a failure faster than its restart)."""
    armed: str | None = None
    """The fault in its fault file (None: nothing)."""
    armed_at: float = 0.0
    acked: str | None = None
    """The fault the process last said it armed."""
    fired: bool = False
    doomed: bool = False
    """Killed by us, not yet reaped."""
    last_step: int = 0
    last_event: str = ""
    last_commit_t: float = 0.0

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]


@dataclass
class StruckFault:
    kind: str
    who: str
    """The group(s) it strikes, comma separated."""
    handle: NetworkFault
    started: float
    heal_at: float
    """Monotonic time to heal it (a flap heals itself when its cycles end)."""
    ended: float | None = None
