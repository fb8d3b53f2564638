"""The --chaos grammar and the schedule's decisions (no processes)."""

from __future__ import annotations

import pytest

from lightning_fthsdp.launch.chaos import ChaosSchedule, Fault, When, parse


def test_grammar() -> None:
    faults = parse("kill:every=20s, hang:at=45s:for=10s:group=b,kill:at=step40:group=a,kill:every=step5:count=2",
                   ["a", "b"])
    assert faults == [
        Fault("kill", every=When(20.0, "s")),
        Fault("hang", at=When(45.0, "s"), duration_s=10.0, group="b"),
        Fault("kill", at=When(40.0, "step"), group="a"),
        Fault("kill", every=When(5.0, "step"), count=2),
    ]
    assert parse("") == []
    assert parse("hang:at=500ms")[0].at == When(0.5, "s")
    assert parse("kill:at=2m")[0].at == When(120.0, "s")


@pytest.mark.parametrize(("spec", "message"), [
    ("crash:at=1s", "kind must be one of kill, hang, partition, slowlink, flap, got 'crash'"),
    ("kill", "exactly one of at=WHEN and every=WHEN"),
    ("kill:at=1s:every=2s", "exactly one of"),
    ("kill:at=soon", "at='soon' is not a duration"),
    ("kill:at=stepx", "a step is written step40"),
    ("kill:at=1s:for=2s", "for=DURATION only goes with hang"),
    ("kill:at=1s:count=2", "count=N only goes with every"),
    ("kill:every=1s:count=0", "count must be a positive integer"),
    ("kill:at=1s:group=z", "group='z' is not one of this job's groups: a, b"),
    ("kill:at=1s:when=2", "options are at=..."),
    ("kill:every=0s", "every must be positive"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="--chaos fault") as err:
        parse(spec, ["a", "b"])
    assert message in str(err.value)


def test_at_fires_once_on_a_training_group_and_waits_while_none_is() -> None:
    schedule = ChaosSchedule(parse("kill:at=step10:group=b"))
    assert schedule.planned == 1
    assert schedule.due(100.0, 9, ["a", "b"]) == []
    assert schedule.due(100.0, 10, ["a"]) == []  # b is not training: the fault stays due
    [injection] = schedule.due(100.0, 12, ["a", "b"])
    assert (injection.kind, injection.group, injection.spec) == ("kill", "b", "kill:at=step10:group=b")
    assert schedule.finished and schedule.due(200.0, 50, ["a", "b"]) == []


def test_every_repeats_from_the_last_injection_and_count_caps_it() -> None:
    schedule = ChaosSchedule(parse("hang:every=10s:count=2:for=3s"), seed=1)
    assert schedule.planned == 2
    assert schedule.due(9.0, 0, ["a", "b"]) == []
    first = schedule.due(11.0, 0, ["a", "b"])
    assert len(first) == 1 and first[0].duration_s == 3.0
    assert schedule.due(20.0, 0, ["a", "b"]) == []  # next one is due at 11 + 10
    assert len(schedule.due(21.5, 0, ["a", "b"])) == 1
    assert schedule.finished


def test_random_targets_are_reproducible_and_unbounded_every_is_unplanned() -> None:
    picks = [[ChaosSchedule(parse("kill:every=1s"), seed=s).due(1.0, 0, ["a", "b", "c"])[0].group
              for s in range(6)] for _ in range(2)]
    assert picks[0] == picks[1] and set(picks[0]) <= {"a", "b", "c"}
    assert ChaosSchedule(parse("kill:every=1s")).planned is None
