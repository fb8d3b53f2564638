"""The network faults of the --chaos grammar (partition, slowlink, flap): parsing, refusals, the schedule (no
processes, no namespaces)."""

from __future__ import annotations

import pytest

from lightning_fthsdp.launch.chaos import ChaosSchedule, Fault, When, parse


def test_network_faults_parse_with_their_options_and_defaults() -> None:
    faults = parse("partition:at=step30:group=b:for=3s,partition:every=20s:from=all:oneway,"
                   "partition:at=1m:group=a:from=b:dir=in,slowlink:at=10s:rate=500kbit:for=10s,"
                   "flap:at=step50:group=a:down=500ms:up=2s:cycles=2,flap:every=30s:count=2,slowlink:at=1s",
                   ["a", "b", "c"], hosts=True)
    assert faults == [
        Fault("partition", at=When(30.0, "step"), duration_s=3.0, group="b"),
        Fault("partition", every=When(20.0, "s"), peer="all", direction="out"),
        Fault("partition", at=When(60.0, "s"), group="a", peer="b", direction="in"),
        Fault("slowlink", at=When(10.0, "s"), duration_s=10.0, rate="500kbit"),
        Fault("flap", at=When(50.0, "step"), group="a", down_s=0.5, up_s=2.0, cycles=2),
        Fault("flap", every=When(30.0, "s"), count=2),
        Fault("slowlink", at=When(1.0, "s")),
    ]
    partition, slowlink, flap = faults[1], faults[6], faults[5]
    assert (partition.group, partition.duration_s) == (None, 5.0)
    assert (slowlink.rate, slowlink.duration_s) == ("1mbit", 5.0)
    assert (flap.down_s, flap.up_s, flap.cycles) == (1.0, 1.0, 3)
    assert parse("partition:at=1s") == [Fault("partition", at=When(1.0, "s"))]  # hosts not known here: accepted


@pytest.mark.parametrize(("spec", "message"), [
    ("partition:at=1s:rate=1mbit", "rate= only goes with slowlink"),
    ("slowlink:at=1s:from=all", "from= only goes with partition"),
    ("kill:at=1s:dir=out", "dir= only goes with partition"),
    ("hang:at=1s:cycles=2", "cycles= only goes with flap"),
    ("flap:at=1s:for=2s", "for=DURATION only goes with hang, partition and slowlink"),
    ("flap:at=1s:count=3", "a flap's down/up cycles are cycles=N"),
    ("partition:at=1s:from=z:group=a", "from='z' is none of lighthouse, all and this job's groups: a, b"),
    ("partition:at=1s:from=b", "from=b needs group=ID of another group"),
    ("partition:at=1s:from=b:group=b", "from=b needs group=ID of another group"),
    ("partition:at=1s:dir=up", "dir must be out (what the group sends vanishes) or in"),
    ("partition:at=1s:oneway:dir=in", "oneway is dir=out: give it once"),
    ("partition:at=1s:oneway:oneway", "oneway is dir=out: give it once"),
    ("slowlink:at=1s:rate=fast", "rate='fast' is not a rate of tc's"),
    ("flap:at=1s:down=soon", "down='soon' is not a duration (e.g. 500ms, 20s, 2m)"),
    ("flap:at=1s:cycles=0", "cycles must be a positive integer"),
    ("kill:at=1s:oneway", "dir= only goes with partition"),
])
def test_bad_network_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="--chaos fault") as err:
        parse(spec, ["a", "b"], hosts=True)
    assert message in str(err.value)


@pytest.mark.parametrize("kind", ["partition", "slowlink", "flap"])
def test_network_faults_need_hosts_and_the_error_names_the_fix(kind: str) -> None:
    with pytest.raises(ValueError, match=f"a {kind} is a network fault between hosts") as err:
        parse(f"kill:at=1s,{kind}:at=2s", ["a", "b"], hosts=False)
    assert "add --hosts (or launch.hosts=true)" in str(err.value)
    assert parse("kill:at=1s,hang:at=2s", ["a", "b"], hosts=False)  # signals need no hosts


def test_the_schedule_hands_network_faults_over_with_their_options() -> None:
    schedule = ChaosSchedule(parse("partition:every=step10:count=2:group=b:from=all:dir=in:for=2s", ["a", "b"]))
    assert schedule.planned == 2
    assert schedule.due(0.0, 9, ["a", "b"]) == []
    [first] = schedule.due(0.0, 10, ["a", "b"])
    assert (first.kind, first.group, first.duration_s) == ("partition", "b", 2.0)
    assert first.fault is not None and (first.fault.peer, first.fault.direction) == ("all", "in")
    assert first.spec == "partition:every=step10:count=2:for=2s:group=b:from=all:dir=in"
    assert schedule.due(0.0, 15, ["a"]) == []  # b not training: it waits
    assert [i.group for i in schedule.due(0.0, 21, ["a", "b"])] == ["b"] and schedule.finished
    [flap] = ChaosSchedule(parse("flap:at=1s:down=200ms:up=300ms:cycles=4")).due(2.0, 0, ["a"])
    assert flap.spec == "flap:at=1s:down=0.2s:up=0.3s:cycles=4"
    [slow] = ChaosSchedule(parse("slowlink:at=1s:rate=2mbps")).due(2.0, 0, ["a"])
    assert slow.spec == "slowlink:at=1s:for=5s:rate=2mbps" and slow.fault is not None and slow.fault.rate == "2mbps"


def test_the_lighthouse_is_cut_from_every_group_whatever_is_training() -> None:
    [cut] = parse("partition:at=step5:group=lighthouse:for=3s", ["a", "b"])
    assert (cut.group, cut.peer) == ("lighthouse", "all")
    [due] = ChaosSchedule([cut]).due(0.0, 5, [])  # its target is a host, not a group that must be training
    assert (due.kind, due.group, due.duration_s) == ("partition", "lighthouse", 3.0)
    with pytest.raises(ValueError, match="group=lighthouse only goes with partition"):
        parse("slowlink:at=1s:group=lighthouse", ["a"])
    with pytest.raises(ValueError, match="from=all"):
        parse("partition:at=1s:group=lighthouse:from=lighthouse", ["a"])
