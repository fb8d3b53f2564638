"""Invariants every fault-tolerant run must keep, read from the groups' JSONL logs (the records of
``lightning_fthsdp.demo.train_plain``; every incarnation of a group appends to the same file).

Each check raises ``InvariantViolated`` (an AssertionError, so pytest reports it as a failed check) naming the step,
the groups and what differs; the tests and the chaos soak (``lightning_fthsdp.testing.soak``) use them.
"""

from __future__ import annotations

import itertools

from lightning_fthsdp.launch.processes import Group
from lightning_fthsdp.protocol.records import RecordKind


class InvariantViolated(AssertionError):
    """A run broke an invariant: the message names the step, the groups and what differs."""


def kept_commits(*groups: Group, rank: int = 0) -> dict[int, int]:
    """step -> the quorum whose commit of that step the job kept: the latest one.

    The commit vote is per group, so a group may commit a step whose exchange the others abandoned (a member was
    declared dead as it completed); they train that step again in a later quorum, and the lone commit is
    superseded: its group died, or it recovers their state (see ``assert_consistent``).
    """
    kept: dict[int, int] = {}
    for group in groups:
        for record in group.records(rank=rank):
            kept[record["step"]] = max(kept.get(record["step"], -1), record["quorum_id"])
    return kept


def assert_consistent(*groups: Group, rank: int = 0) -> set[int]:
    """At every step two groups both committed in the kept quorum, their parameters are bit-identical, and a group
    whose commit was superseded commits nothing more of its own before it recovers or restarts. Returns the steps
    every group committed in the kept quorum."""
    kept = kept_commits(*groups, rank=rank)
    by_group = []
    for group in groups:
        rows = group.records(event=None, rank=rank)
        for i, row in enumerate(rows):
            if row["event"] == RecordKind.COMMIT and row["quorum_id"] != kept[row["step"]]:
                # Discarded attempts, steps followed while a state transfer runs, armed faults and the record of how
                # its start went are not training of its own.
                others = (RecordKind.DISCARD, RecordKind.FOLLOW, RecordKind.FAULT, RecordKind.PHASES)
                after = next((r for r in rows[i + 1:] if r["event"] not in others), None)
                if not (after is None or after["event"] == RecordKind.READY or after.get("catch_up")):
                    raise InvariantViolated(
                        f"{group.replica_id} trained on after its commit of step {row['step']} in quorum "
                        f"{row['quorum_id']} was superseded by quorum {kept[row['step']]}: {after}")
        by_group.append({r["step"]: r["params_sha256"] for r in rows
                         if r["event"] == RecordKind.COMMIT and r["quorum_id"] == kept[r["step"]]})
    common = set.intersection(*(set(d) for d in by_group))
    for step in sorted(set().union(*by_group)):
        digests = {g.replica_id: d[step] for g, d in zip(groups, by_group, strict=True) if step in d}
        if len(set(digests.values())) != 1:
            raise InvariantViolated(f"parameters differ at step {step}: {digests}")
    return common


def contributions_by_step(*groups: Group) -> dict[int, dict[str, list[int]]]:
    """Every kept committed step's data: participant -> the indices of its batches that went into it, merged over
    the groups' logs; groups that committed the same step in the kept quorum must agree on it."""
    kept = kept_commits(*groups)
    steps: dict[int, dict[str, list[int]]] = {}
    for group in groups:
        for record in group.records():
            if record["quorum_id"] != kept[record["step"]]:
                continue  # superseded: the others trained that step again (assert_consistent checks the rest)
            batches = {p: list(range(first, first + record["shares"][p]))
                       for p, first in record["contributions"].items()}
            known = steps.setdefault(record["step"], batches)
            if known != batches:
                raise InvariantViolated(f"step {record['step']}: {known} != {batches}")
    return steps


def assert_exactly_once(*groups: Group) -> dict[str, list[int]]:
    """Over all committed steps 1..N, every group's stream was trained exactly once: 0, 1, 2, ... with no repeat
    and no gap. Returns each group's stream in step order."""
    steps = contributions_by_step(*groups)
    if sorted(steps) != list(range(1, max(steps) + 1)):
        raise InvariantViolated(f"committed steps have a gap: {sorted(steps)}")
    streams: dict[str, list[int]] = {}
    for step in sorted(steps):
        for replica_id, indices in steps[step].items():
            streams.setdefault(replica_id, []).extend(indices)
    for replica_id, indices in streams.items():
        if indices != list(range(len(indices))):
            raise InvariantViolated(f"stream of {replica_id}: {indices}")
    return streams


def assert_no_step_lost(group: Group, final_step: int, rank: int = 0) -> None:
    """The group's committed steps run to final_step with none repeated, and jump ahead only where it caught up
    (its first commit, or one that loaded a peer's state: a survivor whose exchange was aborted while a peer's
    completed falls one step behind and catches up)."""
    commits = group.records(rank=rank)
    steps = [r["step"] for r in commits]
    if steps != sorted(set(steps)):
        raise InvariantViolated(f"{group.replica_id} committed a step twice: {steps}")
    if not steps or steps[-1] != final_step:
        raise InvariantViolated(f"{group.replica_id} ended at {steps[-1:]} not {final_step}")
    for before, after in itertools.pairwise(commits):
        if after["step"] != before["step"] + 1 and not after.get("catch_up"):
            raise InvariantViolated(
                f"{group.replica_id} skipped steps {before['step'] + 1}..{after['step'] - 1} without catching up: "
                f"{steps}")


def assert_no_regression(*groups: Group, rank: int = 0) -> None:
    """No committed step lost: no commit in a quorum that came after one in which a higher step was committed.

    Quorum ids only grow (a restarted lighthouse numbers on from the groups' requests), so a commit of step ``s`` in
    quorum ``q`` after some group committed ``s' > s`` in an older quorum means the job went back: a quorum restarted
    below the committed step. (Log times would not do: a group stopped between its vote and its log line writes a
    legitimate commit late.)
    """
    commits = sorted((r["quorum_id"], r["step"], g.replica_id) for g in groups for r in g.records(rank=rank))
    before: tuple[int, int, str] | None = None  # the highest (step, quorum, group) of the older quorums
    for quorum_id, rows in itertools.groupby(commits, key=lambda c: c[0]):
        here = [(step, quorum_id, replica_id) for _, step, replica_id in rows]
        for step, _, replica_id in here:
            if before is not None and step < before[0]:
                raise InvariantViolated(
                    f"{replica_id} committed step {step} in quorum {quorum_id} although {before[2]} had committed step "
                    f"{before[0]} in quorum {before[1]}: {before[0] - step} committed steps lost")
        before = max(here) if before is None else max(before, *here)
