"""The chaos soak's failures: which to inject next and on whom (``Injector``), drawn from the soak's seeded generator,
and the network faults struck, until each heals.

What it injects, how often and how long: ``soak_config``.

Every injection leaves an up-to-date group untouched (``Soak.holders``, ``Soak.safe_without``; ``soak_config.LIMITS``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_fthsdp.netcluster.cluster import Cluster
from lightning_fthsdp.netcluster.faults import Flap, NetworkFault, cut, flap, partition, slowlink
from lightning_fthsdp.testing.soak_config import NETWORK_SCENARIOS, PHASE_FAULTS, RECOVERY_FAULTS, SCENARIOS
from lightning_fthsdp.testing.soak_records import SoakGroup, StruckFault

if TYPE_CHECKING:
    from lightning_fthsdp.testing.soak import Soak



class Injector:
    """Injects the soak's failures through ``soak`` (its groups, its job, its clock and its events)."""

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.network_faults: list[StruckFault] = []
        self._injected: set[str] = set()

    def inject(self) -> bool:
        """One injection among those possible now: a scenario not injected yet first (so a short run, whose number of
        injections depends on the machine's pace, still sees every kind), then drawn by weight; False if none is."""
        config, rng = self.soak.config, self.soak.rng
        scenarios = {**SCENARIOS, **(NETWORK_SCENARIOS if config.network else {}), **config.weights}
        names = [name for name, weight in scenarios.items() if weight > 0]
        fresh = [name for name in names if name not in self._injected]
        rng.shuffle(fresh)
        order = fresh + rng.choices(names, weights=[scenarios[n] for n in names], k=len(names) * 2)
        for scenario in order:
            if getattr(self, f"_inject_{scenario}")():
                self._injected.add(scenario)
                return True
        return False

    def incarnation_fault(self) -> str | None:
        """The fault of a new incarnation: killed fetching, following or replaying, or none (also drawn: an
        external kill while it starts, see ``Soak._spawn``)."""
        rng = self.soak.rng
        if rng.random() < 0.35:
            return f"sigkill:step=0:phase={rng.choice(RECOVERY_FAULTS)}"
        return None

    def faulted(self, group: SoakGroup) -> bool:
        """Whether a network fault strikes ``group``: one that has not healed, or one that healed after the group's
        last commit (its lease may have run out under the fault: it may be discarding the step its peers commit, and
        be no holder at all)."""
        last_commit = group.current.commits[-1][0] if group.incarnations and group.current.commits else -1.0
        return any(group.replica_id in f.who.split(",") and (f.ended is None or last_commit < f.ended)
                   for f in self.network_faults)

    def heal_due(self, now: float) -> None:
        """Heal the network faults whose time has come (a flap: when its cycles ended)."""
        for fault in self.network_faults:
            if fault.ended is None and (now >= fault.heal_at or (isinstance(fault.handle, Flap) and fault.handle.done)):
                fault.handle.heal()
                fault.ended = now - self.soak.t0
                self.soak.event("healed", fault.who, fault=fault.kind)

    def heal_all(self) -> None:
        """Heal every network fault now (the next ``heal_due`` records each heal not recorded yet)."""
        for fault in self.network_faults:
            fault.heal_at = 0.0
            fault.handle.heal()

    # ------------------------------------------------------------------------------------------ the scenarios

    def _inject_cut_lighthouse(self) -> bool:
        return self._strike("cut_lighthouse", lambda cluster, rid: cut(cluster, rid, ["lighthouse"]))

    def _inject_cut_peers(self) -> bool:
        # The lighthouse keeps one of the two out and the other trains on: both holding the committed state is enough
        # (no injection takes the one kept in while the cut lasts: a group under a network fault is no holder).
        holders = self.soak.holders()
        pairs = [(x, y) for x in holders for y in holders if x.replica_id < y.replica_id]
        if not pairs:
            return False
        assert self.soak.cluster is not None
        x, y = self.soak.rng.choice(pairs)
        self._network_fault("cut_peers", (x, y), partition(self.soak.cluster, x.replica_id, y.replica_id))
        return True

    def _inject_slowlink(self) -> bool:
        return self._strike("slowlink", lambda cluster, rid: slowlink(cluster, rid, self.soak.config.slow_rate))

    def _inject_flap(self) -> bool:
        rng = self.soak.rng
        low, high = (t / 3 for t in self.soak.config.network_fault_s)
        return self._strike("flap", lambda cluster, rid: flap(cluster, rid, down_s=rng.uniform(low, high),
                                                             up_s=rng.uniform(low, high), count=rng.randint(2, 3)))

    def _strike(self, kind: str, make: Callable[[Cluster, str], NetworkFault]) -> bool:
        """Put a network fault made by ``make`` on a holder whose loss leaves another; False if none may take it."""
        candidates = [g for g in self.soak.holders() if self.soak.safe_without(g)]
        if not candidates:
            return False
        assert self.soak.cluster is not None
        group = self.soak.rng.choice(candidates)
        self._network_fault(kind, (group,), make(self.soak.cluster, group.replica_id))
        return True

    def _network_fault(self, kind: str, groups: tuple[SoakGroup, ...], handle: NetworkFault) -> None:
        now = time.monotonic()
        who = ",".join(g.replica_id for g in groups)
        lasts = 3600.0 if isinstance(handle, Flap) else self.soak.rng.uniform(*self.soak.config.network_fault_s)
        heal_at = now + lasts
        self.network_faults.append(StruckFault(kind, who, handle, now - self.soak.t0, heal_at))
        self.soak.event("network", who, fault=kind, detail=handle.detail)

    def _inject_phase(self) -> bool:
        soak = self.soak
        candidates = [g for g in soak.holders() if soak.safe_without(g)]
        if not candidates:
            return False
        group = soak.rng.choice(candidates)
        signal_name = "sigstop" if soak.rng.random() < 0.3 else "sigkill"
        phase = soak.rng.choice(PHASE_FAULTS)
        soak.arm(group, f"{signal_name}:step={group.last_step + soak.rng.randint(1, 3)}:phase={phase}")
        return True

    def _inject_serve(self) -> bool:
        """Kill a group now and arm the source's fault on another: the restart fetches, maybe from it."""
        soak = self.soak
        holders = soak.holders()
        for victim in soak.rng.sample(holders, len(holders)):
            sources = [g for g in holders if g is not victim and soak.safe_without(g, victim)]
            if sources:
                source = soak.rng.choice(sources)
                soak.arm(source, "sigkill:step=0:phase=serve")
                soak.kill(victim, "killed, to be served by an armed source")
                return True
        return False

    def _inject_two(self) -> bool:
        soak = self.soak
        holders = soak.holders()
        pairs = [(x, y) for x in holders for y in holders if x.replica_id < y.replica_id and soak.safe_without(x, y)]
        if not pairs:
            return False
        x, y = soak.rng.choice(pairs)
        if soak.rng.random() < 0.5:
            soak.kill(x, "two at once")
            soak.kill(y, "two at once")
        else:
            soak.kill(x, "two at once")
            os.killpg(y.pid, signal.SIGSTOP)
            soak.event("stop", y.replica_id, why="two at once")
        return True

    def _inject_lighthouse(self) -> bool:
        soak = self.soak
        if not soak.lighthouse_up:
            return False
        candidates = [g for g in soak.holders() if soak.safe_without(g)]
        if not candidates:
            return False
        victim = soak.rng.choice(candidates)
        soak.kill(victim, "killed with the lighthouse")
        if soak.rng.random() < 0.5:
            time.sleep(soak.rng.uniform(0.0, 0.5))  # while the survivors ask for the new quorum
            soak.kill_lighthouse("a group died")
        else:
            soak.kill_lighthouse_when_ready(victim)  # when its restart joins
        return True
