"""One validated source for every timeout of the fault-tolerant path, and the budget of failed commits.

The hierarchy ``heartbeat_interval < heartbeat_timeout < collective_timeout < quorum_timeout < connect_timeout``
is what keeps failure handling fast and never hung: a hang is detected by heartbeat expiry long before the
collective timeout (the backstop) fires, a quorum request outlives a collective that is being aborted, and
connecting a new cross-group process group may take as long as the slowest member needs to reach its quorum.
The replica group's own process group outlasts the longest wait of its leader for a quorum
(``connect_timeout + quorum_timeout`` plus slack), which every other rank of the group sits out in a broadcast.

The lighthouse's ``--heartbeat-timeout-ms`` is the one that declares groups dead: a group's commit lease follows the
lighthouse's value as soon as it answers (see ``membership.client.Heartbeat.lease_valid``).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, fields
from datetime import timedelta

ANSWER_SLACK_MS = 5_000
"""How much longer than the lighthouse's own bound on a request (a quorum request's timeout, a report's heartbeat
timeout) a client waits for its answer: the answer's transit, and a lighthouse running late."""

QUORUM_CLIENT_SLACK_MS = 2 * ANSWER_SLACK_MS
"""Beyond connect + quorum timeouts, what the leader's last quorum request may still take (its HTTP timeout adds
ANSWER_SLACK_MS to the quorum timeout, and a retry may start just before the connect deadline)."""


@dataclass(frozen=True)
class Timeouts:
    """Every bounded wait of the fault-tolerant path, in milliseconds, and the budget of consecutive failed commits.
    Raises ValueError for a value that is not a positive integer or breaks the hierarchy, naming both values."""

    heartbeat_interval_ms: int = 100
    """How often every rank heartbeats to the lighthouse. Default 100 ms. Lower detects lighthouse pushes no faster
    (heartbeats are long-polls answered at once on a membership change) but costs more requests."""

    heartbeat_timeout_ms: int = 2_000
    """A group silent for this long is declared dead (hang detection: SIGSTOP, a wedged GPU). Default 2 s.
    The survivors' stall after a hang is about this value; too low declares slow-but-alive groups dead.
    Crashes are detected at once by the closed connection, independently of this value. The lighthouse's own value
    (its --heartbeat-timeout-ms, which `fthsdp launch` sets from this one) is what declares groups dead, and the
    commit lease follows it; this one bounds a heartbeat request and the lease until the lighthouse first answers."""

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

    process_group_timeout_ms: int = 600_000
    """Timeout of the replica group's own process group (FSDP collectives) and of its link (``manager.link``: the
    commit vote, the quorum broadcast inside the group). Default 10 min. It is how long the other ranks of a group
    with a hung rank wait before the group fails whole and is restarted; it must exceed the leader's longest wait for
    a quorum, connect_timeout_ms + quorum_timeout_ms + 10 s, which the other ranks sit out in the quorum broadcast.
    Large models whose first collectives build NCCL communicators at scale may need more."""

    max_failed_commits: int = 20
    """Consecutive failed commits (discarded steps, steps without a quorum, catch-ups whose transfer failed) after
    which training stops with an error naming the last cause. Default 20. Every failed attempt is bounded by the
    timeouts above, so a job gives up after at most about max_failed_commits x (connect_timeout_ms +
    quorum_timeout_ms); a healthy job meets one or two per failure of another group. Raise it for jobs that should
    wait longer for a lost lighthouse or for min_replicas groups."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                unit = "of milliseconds" if f.name.endswith("_ms") else "(a count)"
                raise ValueError(f"Timeouts.{f.name} must be a positive integer {unit}, got {value!r}")
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
        if self.process_group_timeout_ms <= self.quorum_wait_ms:
            raise ValueError(
                f"Timeouts need process_group_timeout_ms > connect_timeout_ms + quorum_timeout_ms + "
                f"heartbeat_timeout_ms + {QUORUM_CLIENT_SLACK_MS} (the leader's longest wait for a quorum, which the "
                f"group's other ranks sit out in a broadcast), got process_group_timeout_ms="
                f"{self.process_group_timeout_ms}, connect_timeout_ms={self.connect_timeout_ms}, quorum_timeout_ms="
                f"{self.quorum_timeout_ms} and heartbeat_timeout_ms={self.heartbeat_timeout_ms}: raise "
                f"process_group_timeout_ms above {self.quorum_wait_ms} or lower the others"
            )

    @property
    def quorum_wait_ms(self) -> int:
        """The leader's longest wait for one quorum answer: an unreachable lighthouse is retried for
        connect_timeout_ms, then one request may take quorum_timeout_ms (after a probe of the members the lighthouse
        may ask for, at most heartbeat_timeout_ms), plus the client's slack."""
        return self.connect_timeout_ms + self.quorum_timeout_ms + self.heartbeat_timeout_ms + QUORUM_CLIENT_SLACK_MS

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
