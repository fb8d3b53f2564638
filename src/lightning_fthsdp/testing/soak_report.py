"""A soak's figures from what it kept: the healthy groups' stalls by what happened meanwhile, the recoveries and their
phases, the time to heal a network fault, and the result as a table."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from typing import Any

from lightning_fthsdp.testing.soak_records import SoakGroup, StruckFault


def figures(groups: Mapping[str, SoakGroup], events: list[dict[str, Any]], faults: list[StruckFault],
            lighthouse_down: list[tuple[float, float]]) -> dict[str, Any]:
    """The result document's measured part: steps committed, failures (by kind), restarts, stalls, network faults,
    recoveries and their phases."""
    by_kind = failures_by_kind(events)
    done = recoveries(groups)
    return {
        "steps_committed": max((step for g in groups.values() for inc in g.incarnations for _, step in inc.commits),
                               default=0),
        "failures": sum(by_kind.values()),
        "failures_by_kind": dict(sorted(by_kind.items())),
        "restarts": sum(len(g.incarnations) - 1 for g in groups.values()),
        "stall_s": {kind: stats(values) for kind, values in stalls(groups, events, faults, lighthouse_down).items()},
        "network_faults": [{"kind": f.kind, "who": f.who, "detail": f.handle.detail, "at_s": round(f.started, 3),
                            "for_s": None if f.ended is None else round(f.ended - f.started, 3)} for f in faults],
        "recovery_s": {kind: stats([r[kind] for r in done if r[kind] is not None])
                       for kind in ("kill_to_commit", "spawn_to_commit", "imports", "build", "join_to_commit")}
                      | {f"{kind} heal_to_commit": stats(values) for kind, values in healed(groups, faults).items()},
        "recoveries": done,
    }


def failures_by_kind(events: list[dict[str, Any]]) -> dict[str, int]:
    """How many failures of each kind the soak injected: faults fired inside a process (kind and phase), external
    SIGKILLs and SIGSTOPs (and why), lighthouse kills (during what), network faults."""
    by_kind: Counter[str] = Counter()
    for e in events:
        if e["event"] == "fired":
            by_kind[f"{e['spec'].split(':')[0]} {e['phase']}"] += 1
        elif e["event"] == "kill":
            by_kind[f"sigkill external ({e['why']})"] += 1
        elif e["event"] == "stop":
            by_kind[f"sigstop external ({e['why']})"] += 1
        elif e["event"] == "lighthouse killed":
            by_kind[f"lighthouse killed ({e['during']})"] += 1
        elif e["event"] == "network":
            by_kind[f"network {e['fault']}"] += 1
    return dict(by_kind)


def stalls(groups: Mapping[str, SoakGroup], events: list[dict[str, Any]], faults: list[StruckFault],
           lighthouse_down: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Gaps between consecutive commits of a group not failing itself (within one incarnation, not stopped,
    not its own catch-up, not under a network fault of its own), by what else happened meanwhile: ``all``;
    ``quiet`` (nothing); ``failure`` (another group died or stopped); ``recovering`` (another group was
    restarting, no failure); ``lighthouse`` (it was down); ``network`` (another group was under a network
    fault), and ``network KIND`` by the fault's kind."""
    deaths = [e["t"] for e in events if e["event"] in ("died", "stopped", "stop")]
    recovering = [(inc.spawned, inc.commits[0][0] if inc.commits else inc.ended or 1e18, g.replica_id)
                  for g in groups.values() for inc in g.incarnations[1:]]
    out: dict[str, list[float]] = {"all": [], "quiet": [], "failure": [], "recovering": [], "lighthouse": [],
                                   "network": []}
    network = [(f.started, f.ended if f.ended is not None else 1e18, f.who.split(","), f.kind)
               for f in faults]
    for group in groups.values():
        for inc in group.incarnations:
            for (t1, _), (t2, _) in zip(inc.commits, inc.commits[1:], strict=False):
                if any(a < t2 and t1 < b for a, b in inc.stopped) or t2 in inc.catch_up_at or any(
                        a < t2 and t1 < b and group.replica_id in who for a, b, who, _ in network):
                    continue
                gap = t2 - t1
                out["all"].append(gap)
                kinds = [kind for a, b, _, kind in network if a < t2 and t1 < b]
                if kinds:
                    out["network"].append(gap)
                    out.setdefault(f"network {kinds[0]}", []).append(gap)
                elif any(a < t2 and t1 < b for a, b in lighthouse_down):
                    out["lighthouse"].append(gap)
                elif any(t1 - 0.05 <= t <= t2 for t in deaths):
                    out["failure"].append(gap)
                elif any(a < t2 and t1 < b for a, b, rid in recovering if rid != group.replica_id):
                    out["recovering"].append(gap)
                else:
                    out["quiet"].append(gap)
    return out


def healed(groups: Mapping[str, SoakGroup], faults: list[StruckFault]) -> dict[str, list[float]]:
    """Network fault kind -> for each healed one, seconds from its heal to the next commit of every group it struck
    (the slowest of them): how long the job took to have them back."""
    out: dict[str, list[float]] = {}
    for fault in faults:
        if fault.ended is None:
            continue
        after = [min((t for inc in groups[rid].incarnations for t, _ in inc.commits if t >= fault.ended),
                     default=None) for rid in fault.who.split(",")]
        if all(t is not None for t in after):
            out.setdefault(fault.kind, []).append(max(after) - fault.ended)  # type: ignore[type-var,operator]
    return out


def recoveries(groups: Mapping[str, SoakGroup]) -> list[dict[str, Any]]:
    """One entry per restart: from the death and from the spawn to the new incarnation's first commit, and its
    phases (imports, build, join to commit)."""
    out = []
    for group in groups.values():
        for before, inc in zip(group.incarnations, group.incarnations[1:], strict=False):
            first = inc.commits[0][0] if inc.commits else None
            out.append({"group": group.replica_id, "died_at": before.ended, "spawned_at": round(inc.spawned, 3),
                        "fault": inc.fault,
                        "kill_to_commit": span(before.ended, first),
                        "spawn_to_commit": span(inc.spawned, first),
                        # Its phases: interpreter start and imports; model, optimizer and manager built; from
                        # then to its first commit (join the quorum, fetch, follow and replay).
                        "imports": span(inc.spawned, inc.imports_done if first else None),
                        "build": span(inc.imports_done, inc.ready if first else None),
                        "join_to_commit": span(inc.ready, first)})
    return out


def span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(values), "p50": round(statistics.median(ordered), 3), "p99": round(p99, 3),
            "max": round(ordered[-1], 3)}


def format_table(result: dict[str, Any]) -> str:
    """The soak's result as a plain-text table."""
    lines = [f"soak: {result['chaos_s']} s of chaos, seed {result['config']['seed']}, "
             f"{len(result['config']['replica_ids'])} groups, {result['steps_committed']} steps committed, "
             f"{result['failures']} failures, {result['restarts']} restarts",
             "", f"{'failure':<52} {'count':>5}"]
    lines += [f"{kind:<52} {count:>5}" for kind, count in result["failures_by_kind"].items()]
    lines += ["", f"{'seconds':<34} {'n':>5} {'p50':>8} {'p99':>8} {'max':>8}"]
    for title, stats in [*((f"healthy stall ({k})", v) for k, v in result["stall_s"].items()),
                         *((f"recovery ({k.replace('_', ' ')})", v) for k, v in result["recovery_s"].items())]:
        cells = [f"{stats[k]:>8.3f}" if stats[k] is not None else f"{'-':>8}" for k in ("p50", "p99", "max")]
        lines.append(f"{title:<34} {stats['n']:>5} {' '.join(cells)}")
    lines += ["", f"lost steps (lighthouse): {result['lost_steps'] or 'none'}",
              f"invariant checks: {result['invariant_checks']} (consistent, exactly once, no regression)",
              f"settled (all groups training together after the chaos): {result['settled']}",
              f"findings: {len(result['findings'])}", *(f"  - {f}" for f in result["findings"]),
              f"limit: {result['limits']}"]
    return "\n".join(lines)
