"""One validated source for every timeout of the fault-tolerant path.

The hierarchy ``heartbeat_interval < heartbeat_timeout < collective_timeout < quorum_timeout < connect_timeout``
is what keeps failure handling fast and never hung: a hang is detected by heartbeat expiry long before the
collective timeout (the backstop) fires, a quorum request outlives a collective that is being aborted, and
connecting a new cross-group process group may take as long as the slowest member needs to reach its quorum.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, fields
from datetime import timedelta


@dataclass(frozen=True)
class Timeouts:
    """Every bounded wait of the fault-tolerant path, in milliseconds."""

    heartbeat_interval_ms: int = 100
    """How often every rank heartbeats to the lighthouse. Default 100 ms. Lower detects lighthouse pushes no faster
    (heartbeats are long-polls answered at once on a membership change) but costs more requests."""

    heartbeat_timeout_ms: int = 2_000
    """A group silent for this long is declared dead (hang detection: SIGSTOP, a wedged GPU). Default 2 s.
    The survivors' stall after a hang is about this value; too low declares slow-but-alive groups dead.
    Crashes are detected at once by the closed connection, independently of this value."""

    collective_timeout_ms: int = 30_000
    """Backstop for one cross-group collective; normally a hang is aborted at heartbeat expiry first.
    Default 30 s. Must exceed heartbeat_timeout_ms."""

    quorum_timeout_ms: int = 60_000
    """Longest wait for the lighthouse to answer one quorum request. Default 60 s. Must exceed
    collective_timeout_ms and join_timeout_ms."""

    connect_timeout_ms: int = 120_000
    """Longest wait to connect to the lighthouse or to build a cross-group process group. Default 120 s."""

    join_timeout_ms: int = 30_000
    """How long the lighthouse waits for heartbeating stragglers before forming a quorum without them.
    Default 30 s. Must be below quorum_timeout_ms."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Timeouts.{f.name} must be a positive integer of milliseconds, got {value!r}")
        chain = ("heartbeat_interval_ms", "heartbeat_timeout_ms", "collective_timeout_ms", "quorum_timeout_ms",
                 "connect_timeout_ms")
        for lower, upper in itertools.pairwise(chain):
            if getattr(self, lower) >= getattr(self, upper):
                raise ValueError(
                    f"Timeouts need {lower} < {upper}, got {lower}={getattr(self, lower)} and "
                    f"{upper}={getattr(self, upper)}: raise {upper} or lower {lower} "
                    f"(hierarchy: {' < '.join(chain)})"
                )
        if self.join_timeout_ms >= self.quorum_timeout_ms:
            raise ValueError(
                f"Timeouts need join_timeout_ms < quorum_timeout_ms, got join_timeout_ms={self.join_timeout_ms} "
                f"and quorum_timeout_ms={self.quorum_timeout_ms}: a quorum request must outlive the join wait"
            )

    @staticmethod
    def delta(ms: int) -> timedelta:
        return timedelta(milliseconds=ms)


def add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``--<field>`` option per Timeouts field; help text is the field's docstring."""
    docs = field_docs(Timeouts)
    for f in fields(Timeouts):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, help=docs.get(f.name))


def timeouts_from_args(args: argparse.Namespace) -> Timeouts:
    return Timeouts(**{f.name: getattr(args, f.name) for f in fields(Timeouts) if hasattr(args, f.name)})


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal right after each field) of a dataclass, whitespace-normalised, so
    ``--help`` texts, recipes and docs share one source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(following.value.value).split())  # type: ignore[attr-defined]
    return docs
