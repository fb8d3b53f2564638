"""Which nodes of the allocation each replica group runs on, and where it moves when they fail.

The allocation's first ``replicas x nodes_per_replica`` nodes are the groups' (group i: the i-th run of
``nodes_per_replica``), the rest are spares. When an incarnation ends without finishing, each of its nodes that SLURM
reports unusable (down, drained, failing, or gone from the job, as a lost node is under ``--no-kill``) is replaced by
a spare; a group whose last ``move_after`` incarnations all failed on the same nodes moves to spares as a whole (a node
may be broken in ways SLURM does not see). A node SLURM reports unusable is never used again; healthy nodes a group
moved off go to the back of the spares (its failures may have been its own, not theirs). Without enough spares the
group stays where it is if its nodes are usable, else it has nowhere to run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class NodePool:
    """The groups' nodes and the spares (see the module docstring)."""

    nodes: list[str]
    """The allocation's nodes, in SLURM's order."""
    replica_ids: list[str]
    nodes_per_replica: int
    usable: Callable[[str], bool]
    """Whether a node can run a step now (``queries.usable`` and membership of the job)."""
    move_after: int = 2
    """Failed incarnations in a row on the same nodes after which a group moves to spares."""
    assigned: dict[str, list[str]] = field(default_factory=dict)
    spares: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    _failures: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        needed = len(self.replica_ids) * self.nodes_per_replica
        if len(self.nodes) < needed:
            raise ValueError(f"{len(self.replica_ids)} replica groups x {self.nodes_per_replica} nodes need {needed} "
                             f"nodes, the allocation has {len(self.nodes)} ({','.join(self.nodes)}): submit with "
                             f"--nodes={needed} or more")
        for i, replica_id in enumerate(self.replica_ids):
            self.assigned[replica_id] = self.nodes[i * self.nodes_per_replica:(i + 1) * self.nodes_per_replica]
        self.spares = self.nodes[needed:]

    def failed(self, replica_id: str) -> bool:
        """An incarnation of the group ended without finishing: move it off bad nodes. False when it has nowhere
        usable to run."""
        self._failures[replica_id] = self._failures.get(replica_id, 0) + 1
        current = self.assigned[replica_id]
        bad = [node for node in current if not self.usable(node)]
        if not bad and self._failures[replica_id] >= self.move_after:
            bad = list(current)  # it keeps failing where SLURM sees nothing wrong: try other nodes
            if len(self._usable_spares()) < len(bad):
                return True  # no nodes to move to: try again on its own
        if not bad:
            return True
        spares = self._usable_spares()
        if len(spares) < len(bad):
            return False
        replacement = dict(zip(bad, spares, strict=False))
        self.assigned[replica_id] = [replacement.get(node, node) for node in current]
        self.spares = [node for node in self.spares if node not in replacement.values()]
        for node in bad:
            (self.spares if self.usable(node) else self.retired).append(node)
        self._failures[replica_id] = 0
        return True

    def finished(self, replica_id: str) -> None:
        self._failures[replica_id] = 0

    def _usable_spares(self) -> list[str]:
        return [node for node in self.spares if self.usable(node)]
