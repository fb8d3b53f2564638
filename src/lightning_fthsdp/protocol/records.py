"""The run records: what a replica group tells whoever runs it, one JSON line per record, appended to a file as it
trains (``$FTHSDP_RECORD`` under ``fthsdp launch``, docs/launch.md "A script's contract"; the plain demo's
``--log-jsonl``). This module is the one that writes a record (``RecordWriter``) and reads records back
(``RecordReader``, ``read_records``).

It sits in ``protocol`` because the records are a wire format between two processes, like the quorum: a group writes
them (the Lightning callback, the Accelerate helper, the plain demo), its launcher, the soak and the tests read them
(the launcher before it has imported anything of training, so this module needs only the standard library).

Every record has ``event`` (its kind, ``RecordKind``), ``t`` (Unix time when written), ``replica_id`` and ``pid``;
the demo's logs, where every rank writes its own lines, add ``rank``. Launch records come from a group's rank 0
only. The kinds, with the fields every record of the kind carries (``FIELDS``) and then those some writers add:

- ``ready`` (the demo): ``imports_done`` (Unix time its imports ended); its manager is built, no step taken yet.
- ``start`` (Lightning, Accelerate): ``step`` (Lightning's global step, 0 unless resumed): the incarnation began
  training.
- ``commit``: ``step`` (the job's committed step after it); ``loss`` (rank 0's micro-batch; Accelerate: the mean of
  its micro-batches), only for a step this group trained (one it only followed while catching up was computed on
  weights it had not loaded yet). Lightning (with ``FTHSDPStrategy``) and Accelerate add ``participants`` (the ids
  whose gradients went in), ``quorum_size``, ``discarded`` (failed commit attempts of this process so far),
  ``catch_ups`` (of this process) and ``stall_s`` (time of this step spent in discarded attempts); Lightning
  ``checkpoint_loads`` (durable checkpoints this process loaded); Accelerate and the demo ``quorum_id``,
  ``contributions`` (each participant's first batch), ``shares`` (its batch count) and ``catch_up`` (the catch-up
  this step ended); Accelerate ``lr``; the demo ``participants`` (their count), ``params_sha256``, ``optim_sha256``
  and ``batch``.
- ``follow``: ``step``: a step followed while the group's fetched state was in transfer (replayed once it arrives);
  the demo adds its commit fields.
- ``discard`` (the demo): ``step`` and its commit fields: an attempt whose commit vote failed.
- ``val`` (Lightning): ``step`` (the committed step it evaluated) and ``val_loss`` (the held-out loss the
  LightningModule logged as ``val_loss``).
- ``phases``: ``step``, ``milestones`` (the Unix time this process reached each of
  ``lightning_fthsdp.config.anatomy.MILESTONES``): once, with the first step this group trained.
- ``fault`` (the demo): ``action`` (``armed``, with ``spec`` the fault or null for none, or ``fired``, adding
  ``step`` and ``phase``; written just before the signal).
- ``end`` (Lightning, Accelerate): ``step``, ``params_sha256`` (SHA-256 of the full, unsharded final parameters):
  training finished, and the groups compare their final states from the outside.

A record is one append of a whole line, so a kill can only cut the last line short. Readers take complete lines
only, and skip a line that is no JSON: a cut one that whoever appended next ended.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class RecordKind:
    """The kinds of record (their ``event``)."""

    READY = "ready"
    START = "start"
    COMMIT = "commit"
    FOLLOW = "follow"
    DISCARD = "discard"
    VAL = "val"
    PHASES = "phases"
    FAULT = "fault"
    END = "end"


FIELDS: Mapping[str, frozenset[str]] = {
    RecordKind.READY: frozenset({"imports_done"}),
    RecordKind.START: frozenset({"step"}),
    RecordKind.COMMIT: frozenset({"step"}),
    RecordKind.FOLLOW: frozenset({"step"}),
    RecordKind.DISCARD: frozenset({"step"}),
    RecordKind.VAL: frozenset({"step", "val_loss"}),
    RecordKind.PHASES: frozenset({"step", "milestones"}),
    RecordKind.FAULT: frozenset({"action", "spec"}),
    RecordKind.END: frozenset({"step", "params_sha256"}),
}
"""Every kind, with the fields each of its records carries (those the readers rely on)."""


class RecordWriter:
    """Appends the records of one process to ``path``. With no ``path`` (a rank that does not write, a run that keeps
    no records) it writes nothing and still returns each record, so its callers need no branch of their own."""

    def __init__(self, path: str | Path | None, replica_id: str | None, rank: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.replica_id, self.rank = replica_id, rank

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one record of ``kind`` with ``fields``; returns it (its ``t`` is when it was written). Safe from any
        thread: the line is written whole, in one append."""
        if kind not in FIELDS:
            raise ValueError(f"RecordWriter.write: no record kind {kind!r}: use one of {', '.join(FIELDS)}")
        missing = FIELDS[kind] - fields.keys()
        if missing:
            raise ValueError(f"RecordWriter.write: a {kind!r} record needs {', '.join(sorted(missing))} too, got "
                             f"{', '.join(fields) or 'no fields'}")
        record = {"event": kind, **fields, "t": time.time(), "replica_id": self.replica_id}
        if self.rank is not None:
            record["rank"] = self.rank
        record["pid"] = os.getpid()
        if self.path is not None:
            with self.path.open("a") as sink:
                sink.write(json.dumps(record) + "\n")
        return record


class RecordReader:
    """Reads one records file while another process appends to it: each ``read()`` returns the records completed
    since the last (none while the file does not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as source:
            source.seek(self._offset)
            chunk = source.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written (or cut by a kill) waits for its end
        self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line a kill cut short, ended by whoever appended next (or an empty one)
        return records


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a file another process may be appending to."""
    return RecordReader(path).read()


def select(records: Iterable[dict[str, Any]], event: str | None = RecordKind.COMMIT,
           rank: int | None = 0) -> list[dict[str, Any]]:
    """The records of one kind (None: every kind) written by one rank (None: every rank) of a demo's log."""
    return [r for r in records if (event is None or r["event"] == event) and (rank is None or r["rank"] == rank)]
