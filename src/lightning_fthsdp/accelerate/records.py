"""RunRecords: the launch records of one replica group (docs/launch.md, "A script's contract"), written by its rank 0
to ``$FTHSDP_RECORD`` (what ``fthsdp launch`` reads to follow, restart and report on a group)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning_fthsdp.config.env import ENV_RECORD


class RunRecords:
    """Appends one JSON line per record (``t``, ``replica_id``, ``pid`` added) when ``path`` is set and this process
    writes (rank 0 of its group); otherwise every call is a no-op."""

    def __init__(self, path: str | Path | None, replica_id: str, writes: bool) -> None:
        target = path if path is not None else os.environ.get(ENV_RECORD)
        self.requested = bool(target)
        """Whether the group records (the same on all its ranks, unlike ``path``)."""
        self.path = Path(target) if target and writes else None
        self.replica_id = replica_id

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields, "t": time.time(), "replica_id": self.replica_id, "pid": os.getpid()}
        if self.path is not None:
            with self.path.open("a") as sink:
                sink.write(json.dumps(record) + "\n")
        return record
