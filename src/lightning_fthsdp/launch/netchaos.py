"""The network faults of ``--chaos`` (partition, slowlink, flap) on a job whose groups run on hosts of a
``lightning_fthsdp.netcluster.Cluster`` (``fthsdp launch --hosts``): injected, healed when due, recorded.

Group ``ID`` runs on the host named ``ID`` and the lighthouse on host ``lighthouse`` (``Job.hosts``), so a fault on
a group is a fault on its host: a restarted incarnation of a partitioned group is still partitioned until the heal,
as on a real cluster where the node, not the process, is cut off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lightning_fthsdp.launch.chaos import NETWORK_KINDS, Fault, Injection
from lightning_fthsdp.netcluster import faults as net
from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE, Cluster


@dataclass
class Active:
    """A network fault in place on a group's host."""

    replica_id: str
    kind: str
    spec: str
    handle: net.NetworkFault
    placed: float
    """When it was in place (Unix time): what the timeline records, and what its duration counts from."""
    heal_at: float | None
    """When to heal it (Unix time); None: a flap, which ends by itself."""


class NetworkChaos:
    """Injects and heals the network faults of the chaos schedule on ``cluster``'s hosts."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.active: list[Active] = []

    def inject(self, injection: Injection) -> dict[str, Any]:
        """Put the fault in place on the target group's host; returns what the timeline records about it (peers,
        direction, rate, durations). A fault of the same kind already on that group is healed first."""
        fault = injection.fault if injection.fault is not None else Fault(injection.kind)
        if injection.kind not in NETWORK_KINDS:
            raise ValueError(f"NetworkChaos injects {', '.join(NETWORK_KINDS)}, got {injection.kind!r}")
        host = injection.group
        healed = [self.heal(a)["spec"] for a in list(self.active) if a.replica_id == host and a.kind == injection.kind]
        handle: net.NetworkFault
        if injection.kind == "partition":
            peers = self.peers(host, fault.peer)
            handle = net.cut(self.cluster, host, peers, direction=fault.direction)
            detail: dict[str, Any] = {"from": peers, "dir": fault.direction, "for_s": fault.duration_s}
            duration: float | None = fault.duration_s
        elif injection.kind == "slowlink":
            handle = net.slowlink(self.cluster, host, fault.rate)
            detail, duration = {"rate": fault.rate, "for_s": fault.duration_s}, fault.duration_s
        else:
            handle = net.flap(self.cluster, host, fault.down_s, fault.up_s, fault.cycles)
            detail = {"down_s": fault.down_s, "up_s": fault.up_s, "cycles": fault.cycles}
            duration = None
        # Timed once in place (applying it takes a while on a busy machine): it lasts its duration from then.
        placed = time.time()
        self.active.append(Active(host, injection.kind, injection.spec, handle, placed,
                                  None if duration is None else placed + duration))
        return {**detail, "address": self.cluster.address(host), **({"replaced": healed} if healed else {})}

    def due(self, now: float | None = None) -> list[tuple[Active, dict[str, Any]]]:
        """Heal the faults whose time is up (and collect the flaps whose cycles ended); returns each with what the
        timeline records of its heal."""
        now = time.time() if now is None else now
        ended = [a for a in self.active if (a.heal_at is not None and now >= a.heal_at)
                 or (isinstance(a.handle, net.Flap) and a.handle.done)]
        return [(active, self.heal(active)) for active in ended]

    def heal(self, active: Active) -> dict[str, Any]:
        """Undo one fault now; returns what the timeline records of the heal."""
        active.handle.heal()
        if active in self.active:
            self.active.remove(active)
        record: dict[str, Any] = {"kind": active.kind, "spec": active.spec}
        if isinstance(active.handle, net.Flap):
            record["cycles_done"] = active.handle.cycles
            if active.handle.error is not None:
                record["error"] = repr(active.handle.error)
        return record

    def heal_all(self) -> list[tuple[Active, dict[str, Any]]]:
        """Undo every fault still in place (the run is ending); returns each with its heal's record."""
        return [(active, self.heal(active)) for active in list(self.active)]

    def peers(self, host: str, peer: str) -> list[str]:
        """The hosts ``peer`` names (lighthouse, all, or a group's id), never ``host`` itself."""
        if peer == "all":
            return [h for h in self.cluster.hosts if h != host]
        return [LIGHTHOUSE if peer == "lighthouse" else peer]
