"""Structured, named loggers with the ``[replica/rank step N]`` prefix the whole project uses."""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

QUORUM = "fthsdp.quorum"
COMMIT = "fthsdp.commit"
RECOVERY = "fthsdp.recovery"
ERRORS = "fthsdp.errors"


class ReplicaLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with ``[replica/rank step N]`` and adds those fields to ``extra``.

    ``step`` is read through a callable at log time so the prefix is always current.
    """

    def __init__(self, name: str, replica_id: str, rank: int, step: Callable[[], int]) -> None:
        super().__init__(logging.getLogger(name), {})
        self._replica_id = replica_id
        self._rank = rank
        self._step = step

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        step = self._step()
        extra = dict(kwargs.get("extra") or {})
        extra.update(replica_id=self._replica_id, rank=self._rank, step=step)
        kwargs["extra"] = extra
        return f"[{self._replica_id}/{self._rank} step {step}] {msg}", kwargs
