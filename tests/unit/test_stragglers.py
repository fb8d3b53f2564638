"""The straggler rules (``lighthouse.stragglers``) on simulated jobs: detection over the window and the factor, the
time the others waited, eviction within what the quorum needs, readmission, and finding a slow link by trial."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

import pytest

from lightning_fthsdp.lighthouse.stragglers import Change, StragglerPolicy, Stragglers


class Sim:
    """A job whose members each step wait for the slowest: a member's wait is the exchange plus the slowest compute
    less its own. An excluded group reports its compute alone, and asks to come back each step (as its leader's
    requests do); ``exchange(members)`` is how long the exchange itself takes among them."""

    def __init__(self, policy: StragglerPolicy, compute: dict[str, float], keep: int = 1,
                 exchange: Callable[[Collection[str]], float] = lambda members: 0.01) -> None:
        self.s = Stragglers(policy)
        self.compute, self.keep, self.exchange = compute, keep, exchange
        self.out: set[str] = set()
        self.times: Counter[str] = Counter()
        self.changes: list[tuple[str, str]] = []
        self.steps = 0

    def active(self) -> list[str]:
        return sorted(rid for rid in self.compute if rid not in self.out)

    def run(self, steps: int) -> list[tuple[str, str]]:
        first = len(self.changes)
        for _ in range(steps):
            self.steps += 1
            members = self.active()
            slowest = max(self.compute[m] for m in members)
            for rid in sorted(self.compute):
                if rid not in members:
                    self.s.record(rid, self.compute[rid])
                    if rid in self.out and self.s.readmission(rid, self.times[rid]) is not None:
                        self.out.discard(rid)
                        self.s.admitted(rid)
                        self.changes.append(("readmit", rid))
                    continue
                wait = self.exchange(members) + slowest - self.compute[rid]
                if self.s.record(rid, self.compute[rid], wait, (len(members), self.steps), members):
                    for change in self.s.review(self.active(), self.keep):
                        self._apply(change)
        return self.changes[first:]

    def _apply(self, change: Change) -> None:
        self.changes.append((change.kind, change.replica_id))
        if change.kind in ("evict", "trial"):
            self.out.add(change.replica_id)
            self.times[change.replica_id] += 1
            self.s.excluded(change.replica_id)


def test_a_policy_names_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="mode must be one of off, report, evict, got 'kick'"):
        StragglerPolicy("kick")
    with pytest.raises(ValueError, match=r"factor must be a number > 1 .* got 1.0"):
        StragglerPolicy("report", 1.0)
    with pytest.raises(ValueError, match=r"window must be an integer >= 3 .* got 2"):
        StragglerPolicy("report", 2.0, 2)
    assert StragglerPolicy().args() == [] and StragglerPolicy("evict", 3.0, 5).args() == [
        "--straggler-policy", "evict", "--straggler-factor", "3", "--straggler-window", "5"]


def test_a_group_three_times_slower_is_flagged_once_its_window_is_full_and_the_others_waited_for_it() -> None:
    sim = Sim(StragglerPolicy("report", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.3})
    assert sim.run(4) == []  # judged only on a full window
    assert sim.run(1) == [("flagged", "c")]
    assert sim.run(10) == []  # report: flagged once, never taken out
    status = sim.s.group_json("c")
    assert status["straggler"] and status["step_time_s"] == 0.3
    # Each round a and b waited 0.2 s beyond the exchange itself: 5 rounds of the window, 0.2 s each.
    assert status["waited_for_s"] == pytest.approx(1.0)
    assert sim.s.group_json("a") == {"step_time_s": 0.1, "waited_for_s": 0.0, "straggler": False}
    assert sim.s.to_json()["step_time_s"] == 0.1 and not sim.s.to_json()["link_bound"]


def test_the_factor_decides_and_one_slow_step_in_the_window_is_no_straggler() -> None:
    assert Sim(StragglerPolicy("report", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.15}).run(20) == []
    assert Sim(StragglerPolicy("report", 1.4, 5), {"a": 0.1, "b": 0.1, "c": 0.15}).run(20) == [("flagged", "c")]
    sim = Sim(StragglerPolicy("report", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.1})
    sim.run(5)
    sim.compute["c"] = 1.0
    assert sim.run(1) == []  # one step of ten times the others' in a window of five: the median is unmoved
    sim.compute["c"] = 0.1
    assert sim.run(10) == []


def test_a_straggler_that_speeds_up_is_cleared() -> None:
    sim = Sim(StragglerPolicy("report", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.3})
    assert sim.run(5) == [("flagged", "c")]
    sim.compute["c"] = 0.1
    assert sim.run(5) == [("cleared", "c")]


def test_off_measures_and_flags_nothing() -> None:
    sim = Sim(StragglerPolicy("off", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.3})
    assert sim.run(20) == []
    assert sim.s.group_json("c")["step_time_s"] == 0.3 and not sim.s.group_json("c")["straggler"]


def test_evict_takes_it_out_keeps_it_out_while_slow_and_admits_it_once_it_keeps_pace() -> None:
    sim = Sim(StragglerPolicy("evict", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.3})
    assert sim.run(5) == [("flagged", "c"), ("evict", "c")]
    assert sim.run(30) == []  # still slow: out, whatever the time
    sim.compute["c"] = 0.1  # its host recovered: its window fills with steps that keep pace
    assert sim.run(4) == [("readmit", "c"), ("cleared", "c")]  # 3 of its 5 steps keep pace: its median does
    assert "c" in sim.active()


def test_the_shortest_time_out_doubles_with_each_exclusion() -> None:
    sim = Sim(StragglerPolicy("evict", 2.0, 4), {"a": 0.1, "b": 0.1, "c": 0.1})
    sim.run(4)
    sim.s.excluded("c")  # out (say, by a trial) while keeping pace
    sim.out.add("c")
    sim.times["c"] = 3
    sim.run(15)
    assert "c" in sim.out  # 15 rounds < 4 x 2^2
    assert sim.run(1) == [("readmit", "c")]
    assert sim.steps - 4 == 16


def test_evict_never_leaves_fewer_groups_than_the_quorum_needs() -> None:
    sim = Sim(StragglerPolicy("evict", 2.0, 5), {"a": 0.1, "b": 0.1, "c": 0.3}, keep=3)
    assert sim.run(10) == [("flagged", "c")]
    two = Sim(StragglerPolicy("evict", 2.0, 5), {"a": 0.1, "b": 0.3}, keep=1)
    assert two.run(5) == [("flagged", "b"), ("evict", "b")]  # with min_replicas 1, a alone trains on


def test_a_slow_link_is_found_by_trial_and_the_innocent_come_back_at_once() -> None:
    # c's link makes every member's exchange take 0.25 s; compute is the same everywhere, so no report names it.
    def exchange(members: Collection[str]) -> float:
        return 0.25 if "c" in members else 0.01

    sim = Sim(StragglerPolicy("evict", 2.0, 4), {"a": 0.1, "b": 0.1, "c": 0.1}, exchange=exchange)
    assert sim.run(4) == [("trial", "a")]  # the first in id order: nothing tells the three apart yet
    assert sim.s.to_json()["trial"] == "a"
    assert sim.run(4) == [("acquitted", "a")]  # 4 rounds without it, the exchange no faster
    assert sim.run(1) == [("readmit", "a")]  # at its next request
    assert sim.run(7) == [("trial", "b"), ("acquitted", "b")]
    assert sim.run(8) == [("readmit", "b"), ("trial", "c"), ("convicted", "c"), ("flagged", "c")]
    assert "c" in sim.out and sim.s.group_json("c")["straggler"] and sim.s.readmission("c", 1) is None
    # Its compute keeps pace: it comes back on trial after the shortest time out (4 rounds: its first exclusion)...
    assert sim.run(4) == [("readmit", "c")]
    # ...and, the job link-bound again, it is the first tried, found again, and out twice as long (8 rounds).
    assert sim.run(9) == [("cleared", "c"), ("trial", "c"), ("convicted", "c"), ("flagged", "c")]
    convicted = sim.steps - 1
    sim.run(convicted + 7 - sim.steps)
    assert "c" in sim.out
    assert sim.run(1) == [("readmit", "c")]


def test_a_slow_network_tries_each_group_once_then_waits_longer_each_time() -> None:
    sim = Sim(StragglerPolicy("evict", 2.0, 3), {"a": 0.1, "b": 0.1, "c": 0.1}, exchange=lambda members: 0.25)
    changes = sim.run(18)
    assert [rid for kind, rid in changes if kind == "trial"] == ["a", "b", "c"], changes
    assert [rid for kind, rid in changes if kind == "acquitted"] == ["a", "b", "c"], changes

    def next_trial() -> int:
        while not any(kind == "trial" for kind, _ in sim.run(1)):
            pass
        return sim.steps

    # None was the slow link: found at round 21 (a window of rounds with all in), then quiet for window x groups
    # rounds; after the next fruitless cycle (ending at round 48) for twice as long.
    assert next_trial() == 21 + 9
    for _ in range(2):
        next_trial()
    assert next_trial() == 48 + 18


def test_two_groups_are_never_tried_for_a_slow_link() -> None:
    sim = Sim(StragglerPolicy("evict", 2.0, 3), {"a": 0.1, "b": 0.1}, exchange=lambda members: 0.25)
    assert sim.run(20) == []


def test_rounds_close_only_with_every_member_and_stale_ones_are_dropped() -> None:
    s = Stragglers(StragglerPolicy("report", 2.0, 3))
    assert not s.record("a", 0.1, 0.2, (1, 1), ("a", "b"))
    assert s.record("b", 0.3, 0.01, (1, 1), ("a", "b"))
    for step in range(2, 20):  # b never reports these: each is dropped once enough newer ones are open
        assert not s.record("a", 0.1, 0.2, (1, step), ("a", "b"))
    assert s.rounds == 1 and s.group_json("b")["waited_for_s"] == pytest.approx(0.19)
    assert not s.record("c", 0.1, 0.2, (1, 30), ("a", "b"))  # not a member of that quorum: compute only
