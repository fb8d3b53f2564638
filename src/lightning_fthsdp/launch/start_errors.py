"""The error that ended a replica group's incarnation, read from its log: what the launcher compares to tell a start
that fails the same way every time (a deterministic set-up error: it ends the job) from one that failed by chance."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SAME_FAILED_STARTS = 2
"""Starts of a group in a row that ended with the same error before the group's first committed step, no fault
overlapping them: that error is the group's set-up, not chance, and restarting cannot mend it (the job ends, printing
it once). Once a group committed a step its set-up works: its failures use the restart budget instead."""
TAIL_BYTES = 64 << 10
"""How much of the log's end is read: a start's last traceback is near it."""
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")  # object addresses in reprs differ between processes, not the error
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch.distributed prefixes a rank's traceback lines with it
_CHAIN = ("Traceback (most recent call last):", "During handling of the above exception",
          "The above exception was the direct cause")


def last_error(log: Path) -> str | None:
    """The exception line of the log's last Python traceback (``ValueError: ...``), else its last non-empty line (a
    ``SystemExit("message")`` prints only the message); None for an empty or missing log."""
    try:
        with log.open("rb") as source:
            source.seek(max(0, source.seek(0, 2) - TAIL_BYTES))
            lines = [_RANK_PREFIX.sub("", line) for line in source.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    error, in_traceback = None, False
    for line in lines:
        if line.startswith(_CHAIN[0]):
            in_traceback = True
        elif in_traceback and line.strip() and not line[0].isspace() and not line.startswith(_CHAIN[1:]):
            error, in_traceback = line.strip(), False  # the first unindented line after the frames
    if error is None:
        error = next((line.strip() for line in reversed(lines) if line.strip()), None)
    return _ADDRESS.sub("0x…", error) if error is not None else None


def describe(failure: dict[str, Any]) -> str:
    """The launcher's one message about a group whose starts failed the same way (a ``Supervisor.start_failure``)."""
    return (f"group {failure['replica_id']}: {SAME_FAILED_STARTS} starts in a row failed the same way before a "
            f"committed step (exit code {failure['exit_code']}; last log {failure['log']}):\n  {failure['error']}\n"
            "restarting cannot mend a set-up error: stopping every process")
