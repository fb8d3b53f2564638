"""``report.json``: what a launch measured, from the groups' JSONL records and the launcher's timeline.

Times are seconds. ``t0`` is the job's first committed step (start-up and imports are not training time).

- ``failures_injected``: failures the chaos schedule injected (kills, hangs and, with ``--hosts``, network faults:
  partitions, slow links, flaps; the timeline has each one's details and a ``heal`` event when it ended).
- ``committed_steps``: the job's highest committed step.
- ``discarded_steps``: failed commit attempts, summed over groups (each was retrained on the same batch).
- ``stalls_s``: one per failure: from the injection until a group other than the target committed a step
  (the healthy groups' standstill: failure detection, the failed step's retry, reconfiguration).
- ``recoveries``: one per failure whose target trained again: ``recovery_s`` from the injection until the
  target's first committed step after it (restart and catch-up included), as ``fthsdp simulate --from-report``
  expects; ``caught_up``: the target loaded a peer's state; ``from_checkpoint``: it loaded the durable checkpoint a
  quorum resumed from (no live group held the job's state); neither: it resumed from its own state.
- ``lost_steps``: each quorum the lighthouse restarted below the job's committed step, because no group holding
  it came back in time (``quorum_id``, ``from_step``, ``committed_step``, ``lost_steps``); empty when none was.
- ``final_params_identical``: at least one group finished and every group that finished holds full final parameters
  with the same digest. Groups that did not finish are not compared (they are in ``unfinished``); a finished group
  with another digest than the rest is in ``diverged``, which is a defect.
- ``unfinished``: each group that did not finish training (``replica_id``, ``status``: still ``starting`` or ``down``
  when the run ended, ``abandoned`` once no peer was left to catch up from, ``failed`` with its restarts used up,
  ``exited`` 0 without its ``end`` record (never restarted: its final parameters are unknown), ``start_failed``
  when its starts failed the same way before its first committed step (the job was stopped); ``last_step``: its last
  committed step; ``job_step``: the job's committed step when training ended; ``restarts``). Empty when every group
  finished.
- ``job_completed``: the job trained to its target step and ended as a fault-tolerant job should: every group
  that finished holds the same final parameters, and no group used up its restarts (``failed``), failed to start
  (``start_failed``), ended without saying it finished (``exited``) or diverged. A group still restarting when
  training ended (``abandoned``, ``hung``) does not make it incomplete: the job's state is whole in the finished
  groups. The launcher's exit code is 0 exactly when this is true.
- ``groups``: per group its ``final_step``, ``restarts``, ``exit_codes``, ``status``, ``discarded``, ``catch_ups``,
  ``params_sha256`` and ``failed_starts`` (each incarnation that ended with an error before the group's first
  committed step, no fault of the chaos schedule, lost node or lighthouse outage overlapping it: ``incarnation``,
  ``exit_code``, ``error``, the last error line of its ``log``).
- ``diverged``: the finished groups whose final parameters differ from those most finished groups hold (all of them
  on a tie); empty when ``final_params_identical``.
- ``restart_phases``: one per restart that trained again, the anatomy of the restart
  (``lightning_fthsdp.config.anatomy``): ``replica_id``, ``incarnation``, ``after`` (``kill`` or the exit that
  ended the previous incarnation), ``wait_s`` (from the launcher seeing it dead until it started the new process,
  or released its standby: ``launch.restart_delay_s``), ``standby`` (it was started ahead, ``launch.standby``: its
  process start and imports, ``ahead_s``, were done before the failure and are 0 in its phases), ``phases``
  (seconds per phase, from the process start, or the release of a standby, to its first trained step), ``total_s``
  (their sum), ``caught_up``, ``trained_at_step``. ``start_phases``: the same for every
  group's first start (no failure: the in-run reference).
- ``val_loss``: the held-out validation loss at the last step any group validated (``final``: the mean over the
  groups that validated it; they hold identical parameters) and ``val_losses`` every group's evaluations.
- ``step_s``: the median duration of a fault-free step (every replica participating), the job's typical step
  (``fthsdp simulate --from-report`` replaces it by the projected job's step time).
- ``effective_training_time``: useful work / wall time between the first and the last committed step, where a
  step's useful work is (participants / replicas) x the median duration of fault-free steps (all replicas
  participating). 1.0 is a fault-free run; a stall earns nothing, a step with k of R groups earns k/R.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.launch.chaos import KINDS
from lightning_fthsdp.launch.supervisor import EXITED, FAILED, START_FAILED, GroupState
from lightning_fthsdp.protocol.records import RecordKind

ETT_DEFINITION = ("sum over committed steps of (participants / replicas) x median fault-free step time, divided by "
                  "the wall time from the first to the last committed step")


def build_report(groups: dict[str, GroupState], transitions: list[dict[str, Any]], *, replicas: int,
                 max_steps: int, meta: dict[str, Any]) -> dict[str, Any]:
    """The report as a JSON-able dict (fields in the module docstring, plus per-group details and the timeline)."""
    steps = [r for g in groups.values() for r in g.records if r["event"] == RecordKind.COMMIT]
    t0 = min((r["t"] for r in steps), default=0.0)
    injections = [e for e in transitions if e["event"] in KINDS]
    stalls, recoveries = [], []
    for event in injections:
        others = [r["t"] for r in steps if r["t"] > event["t"] and r["replica_id"] != event["replica_id"]]
        if others:
            stalls.append(round(min(others) - event["t"], 3))
        struck = groups.get(event["replica_id"])  # None: the lighthouse's host (a partition of it)
        mine = [r for r in (struck.records if struck is not None else []) if r["event"] == RecordKind.COMMIT
                and r["t"] > event["t"] and (event["event"] != "kill" or r["incarnation"] > event["incarnation"])]
        if mine:
            recoveries.append({"replica_id": event["replica_id"], "kind": event["event"],
                               "injected_at_s": round(event["t"] - t0, 3),
                               "recovery_s": round(mine[0]["t"] - event["t"], 3),
                               "rejoined_at_step": mine[0]["step"], "caught_up": mine[0].get("catch_ups", 0) > 0,
                               "from_checkpoint": mine[0].get("checkpoint_loads", 0) > 0})
    finals = {g.replica_id: g.params_sha256 for g in groups.values() if g.params_sha256 is not None}
    job_step = max((r["step"] for r in steps), default=0)
    starts = _start_phases(groups, transitions)
    losses = _loss_by_step(steps)
    vals = [r for g in groups.values() for r in g.records if r["event"] == RecordKind.VAL]
    val_step = max((r["step"] for r in vals), default=None)
    finals_val = [r["val_loss"] for r in vals if r["step"] == val_step]
    head, tail = losses[:10], losses[-10:]
    unfinished = [{"replica_id": g.replica_id, "status": g.status, "last_step": g.step, "job_step": job_step,
                   "restarts": g.restarts} for g in groups.values() if g.replica_id not in finals]
    identical = len(set(finals.values())) == 1
    completed = (identical and meta.get("outcome", "finished") == "finished"
                 and all(groups[r].step == max_steps for r in finals)
                 and not any(g["status"] in (FAILED, START_FAILED, EXITED) for g in unfinished))
    return {
        **meta,
        "replicas": replicas,
        "failures_injected": len(injections),
        "committed_steps": job_step,
        "target_steps": max_steps,
        "discarded_steps": sum(g.discarded for g in groups.values()),
        "stalls_s": stalls,
        "recoveries": recoveries,
        "final_params_identical": identical,
        "unfinished": unfinished,
        "job_completed": completed,
        "diverged": _diverged(finals),
        "restart_phases": [s for s in starts if s["incarnation"] > 0],
        "start_phases": [s for s in starts if s["incarnation"] == 0],
        "step_s": _typical_step(steps, replicas),
        "effective_training_time": _ett(steps, replicas),
        "effective_training_time_definition": ETT_DEFINITION,
        "loss": {"first": _mean(head), "last": _mean(tail), "fell": bool(head and tail and _mean(tail) < _mean(head))},
        "groups": {g.replica_id: {"final_step": g.step, "restarts": g.restarts, "exit_codes": g.exit_codes,
                                  "status": g.status, "discarded": g.discarded, "catch_ups": g.catch_ups,
                                  "params_sha256": g.params_sha256, "failed_starts": g.failed_starts}
                   for g in groups.values()},
        "timeline": [{**e, "t": round(e["t"] - t0, 3)} for e in transitions],
        "val_loss": {"step": val_step, "final": _mean(finals_val)},
        "val_losses": {g.replica_id: [[round(r["t"] - t0, 3), r["step"], round(r["val_loss"], 5)]
                                      for r in g.records if r["event"] == RecordKind.VAL] for g in groups.values()},
        "losses": {g.replica_id: [[round(r["t"] - t0, 3), r["step"], round(r["loss"], 5)]
                                  for r in g.records if r["event"] == RecordKind.COMMIT and "loss" in r]
                   for g in groups.values()},
    }


def _diverged(finals: dict[str, str]) -> list[str]:
    """The finished groups outside the largest set holding one digest (every finished group on a tie)."""
    holders: dict[str, list[str]] = {}
    for replica_id, digest in finals.items():
        holders.setdefault(digest, []).append(replica_id)
    if len(holders) < 2:
        return []
    sizes = sorted((len(ids) for ids in holders.values()), reverse=True)
    if sizes[0] == sizes[1]:
        return sorted(finals)
    majority = max(holders.values(), key=len)
    return sorted(r for r in finals if r not in majority)


def _start_phases(groups: dict[str, GroupState], transitions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The anatomy of every start that trained (see the module docstring), from each incarnation's ``phases``
    record and the launcher's timeline (what ended the incarnation before, when)."""
    out = []
    for g in groups.values():
        for record in (r for r in g.records if r["event"] == RecordKind.PHASES):
            incarnation = record["incarnation"]
            marks = record["milestones"]
            phases = anatomy.phases(marks)
            if not phases:
                continue
            entry: dict[str, Any] = {"replica_id": g.replica_id, "incarnation": incarnation, "phases": phases,
                                     "total_s": round(sum(phases.values()), 3), "caught_up": "fetched" in marks,
                                     "trained_at_step": record["step"]}
            if incarnation > 0:
                before = [e for e in transitions if e["replica_id"] == g.replica_id
                          and e["incarnation"] == incarnation - 1]
                injected = [e["event"] for e in before if e["event"] in KINDS]
                down = [e["t"] for e in before if e["event"] == "down"]
                began = marks.get("released", marks.get("spawned"))
                entry["after"] = injected[-1] if injected else "exit"
                entry["wait_s"] = round(max(0.0, began - down[-1]), 3) if down and began is not None else None
            entry["standby"] = "released" in marks
            entry["ahead_s"] = anatomy.ahead(marks)
            out.append(entry)
    return sorted(out, key=lambda e: (e["incarnation"], e["replica_id"]))


def _loss_by_step(steps: list[dict[str, Any]]) -> list[float]:
    """Mean loss over the groups that recorded each step, in step order."""
    by_step: dict[int, list[float]] = {}
    for r in steps:
        if "loss" in r:  # a step a group only followed has none
            by_step.setdefault(r["step"], []).append(r["loss"])
    return [statistics.fmean(v) for _, v in sorted(by_step.items())]


def _durations(steps: list[dict[str, Any]]) -> tuple[list[tuple[float, int]], float]:
    """Each committed step's duration (since the job's previous step) with its participants; the wall time from the
    first committed step to the last."""
    first: dict[int, tuple[float, int]] = {}  # step -> (when the job first committed it, its participants)
    for r in sorted(steps, key=lambda r: r["t"]):
        first.setdefault(r["step"], (r["t"], len(r.get("participants", [])) or 1))
    ordered = sorted(first.items())
    durations = [(b[1][0] - a[1][0], b[1][1]) for a, b in itertools.pairwise(ordered)]
    return durations, ordered[-1][1][0] - ordered[0][1][0] if ordered else 0.0


def _typical_step(steps: list[dict[str, Any]], replicas: int) -> float | None:
    """The median fault-free step (every replica participating; any step if none was); None under two steps."""
    durations, _ = _durations(steps)
    if not durations:
        return None
    healthy = [d for d, n in durations if n >= replicas] or [d for d, _ in durations]
    return round(statistics.median(healthy), 5)


def _ett(steps: list[dict[str, Any]], replicas: int) -> float:
    typical = _typical_step(steps, replicas)
    durations, wall = _durations(steps)
    if typical is None or wall <= 0:
        return 0.0
    useful = sum(min(n, replicas) / replicas * typical for _, n in durations)
    return round(min(1.0, useful / wall), 4)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 5) if values else None
