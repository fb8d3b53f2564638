"""Stragglers at a real lighthouse (a thread, real loopback HTTP): the step times the groups report, the straggler
flagged in ``/status``, ``/metrics`` and the event log, taken out of the quorum (evict) and admitted again, behind,
once it keeps pace; and the times refused naming the field (``lighthouse.stragglers``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from lightning_fthsdp.cli import main as cli_main
from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy
from lightning_fthsdp.recipes import load_recipe
from tests.k8s.test_manifests import by_kind, manifests
from tests.paths import ROOT
from tests.unit.test_lighthouse import Client, form, hb, lighthouse, qr, replica
from tests.unit.test_lighthouse_metrics import scrape

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse

WINDOW = 3
SLOW = {"a": 0.1, "b": 0.1, "c": 0.3}


def timed(body: dict[str, Any], compute_s: float, wait_s: float | None) -> dict[str, Any]:
    return {**body, "compute_s": compute_s, "wait_s": wait_s}


class Job:
    """Groups that ask each step with the times of their last one: each member waits for the slowest."""

    def __init__(self, url: str, compute: dict[str, float]) -> None:
        self.url, self.compute = url, dict(compute)
        self.beats = {rid: Client(url) for rid in compute}
        for rid, client in self.beats.items():
            client.call("POST", "/v1/heartbeat", hb(rid))
        self.clients = {rid: Client(url) for rid in compute}
        self.quorum_id = form(url, *compute)[0]["quorum_id"]
        self.members: tuple[str, ...] = tuple(sorted(compute))
        self.steps = dict.fromkeys(compute, 0)

    def step(self) -> dict[str, dict[str, Any]]:
        """Every group asks once, the members reporting their exchange; returns each one's answer. An excluded group
        asks first: admitted, it is in the quorum the members' requests complete (asking after them, it would wait
        for the next one)."""
        slowest = max(self.compute[m] for m in self.members)
        for rid, client in sorted(self.clients.items(), key=lambda item: (item[0] in self.members, item[0])):
            member = rid in self.members
            if member:
                self.steps[rid] += 1
                body = qr(rid, self.steps[rid], self.quorum_id, self.members, committed_in=self.quorum_id)
            else:  # excluded: it trained its step again and has no exchange to report
                body = qr(rid, self.steps[rid], -1, commit_failed=True)
            client.send("POST", "/v1/quorum", timed(body, self.compute[rid], 0.01 + slowest - self.compute[rid]
                                                    if member else None))
        answers = {}
        for rid, client in self.clients.items():
            code, answers[rid] = client.recv()
            assert code == 200, answers[rid]
        quorum = next(a for a in answers.values() if "members" in a)
        self.quorum_id, self.members = quorum["quorum_id"], tuple(m["replica_id"] for m in quorum["members"])
        return answers

    def status(self) -> dict[str, Any]:
        return Client(self.url).status()

    def events(self) -> list[dict[str, Any]]:
        return Client(self.url).call("GET", "/events")[1]["events"]


def test_report_flags_the_straggler_everywhere_and_keeps_it_in(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2, straggler_policy=StragglerPolicy("report", 2.0, WINDOW))
    job = Job(url, SLOW)
    for _ in range(WINDOW + 1):  # the first step reports the times of none
        answers = job.step()
        assert all("members" in a for a in answers.values()), answers
    status = job.status()
    c, a = replica(status, "c"), replica(status, "a")
    assert c["straggler"] and c["step_time_s"] == 0.3 and c["waited_for_s"] == pytest.approx(0.2 * WINDOW)
    assert not a["straggler"] and a["step_time_s"] == 0.1 and a["waited_for_s"] == 0
    assert status["stragglers"]["policy"] == "report" and status["stragglers"]["step_time_s"] == 0.1
    assert status["excluded"] == {} and status["members"] == ["a", "b", "c"]
    flagged = [e for e in job.events() if e["kind"] == "straggler"]
    assert [e["replica_id"] for e in flagged] == ["c"] and "0.300 s" in flagged[0]["text"], flagged
    metrics = scrape(url)
    assert metrics["fthsdp_stragglers"][()] == 1 and metrics["fthsdp_step_time_seconds"][()] == 0.1
    assert metrics["fthsdp_straggler_step_time_seconds"] == {(("replica_id", "c"),): 0.3}


def test_evict_takes_the_straggler_out_and_admits_it_behind_once_it_keeps_pace(
        lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2, straggler_policy=StragglerPolicy("evict", 2.0, WINDOW))
    job = Job(url, SLOW)
    for _ in range(WINDOW - 1):
        assert all("members" in a for a in job.step().values())
    answers = job.step()  # the round that fills c's window: c is out, a and b go on alone
    assert answers["c"]["excluded"]["reason"] == "straggler" and answers["c"]["probe"] == {}, answers["c"]
    assert job.members == ("a", "b")
    status = job.status()
    assert replica(status, "c")["state"] == "excluded" and replica(status, "c")["straggler"]
    assert status["excluded"]["c"]["reason"] == "straggler"
    # Still as slow: out, each of its requests held about one of the job's steps, never in a tight loop.
    started = time.monotonic()
    for _ in range(WINDOW):
        answers = job.step()
        assert "excluded" in answers["c"] and job.members == ("a", "b"), answers["c"]
    assert time.monotonic() - started > WINDOW * 0.1
    # Its host recovered: once its median keeps pace (and it was out for its shortest time) it comes back, behind.
    job.compute["c"] = 0.1
    for _ in range(WINDOW):
        answers = job.step()
        if "members" in answers["c"]:
            break
    assert job.members == ("a", "b", "c"), answers["c"]
    assert answers["c"]["catch_up_from"] == {"c": "a"} and job.status()["excluded"] == {}
    kinds = [(e["kind"], e["replica_id"]) for e in job.events()]
    assert kinds.index(("straggler", "c")) < kinds.index(("exclude", "c")) < kinds.index(("readmit", "c")), kinds


def test_a_straggler_is_admitted_again_when_the_quorum_cannot_do_without_it(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2, straggler_policy=StragglerPolicy("evict", 2.0, WINDOW))
    job = Job(url, SLOW)
    for _ in range(WINDOW):
        job.step()
    assert job.members == ("a", "b")
    job.beats["b"].crash()  # b dies: a alone is below min_replicas, so the slow c is better than no job
    job.clients.pop("b").conn.close()
    deadline = time.monotonic() + 10
    while replica(job.status(), "b")["alive"]:
        assert time.monotonic() < deadline, "b's death was not seen"
        time.sleep(0.02)
    answers = job.step()
    assert [m["replica_id"] for m in answers["a"]["members"]] == ["a", "c"], answers


@pytest.mark.parametrize(("field", "value", "says"), [
    ("compute_s", -1, "field 'compute_s' must be a number of seconds from 0"),
    ("compute_s", "fast", "field 'compute_s' must be a number of seconds"),
    ("compute_s", 1e9, "one day"),
    ("wait_s", True, "field 'wait_s' must be a number of seconds"),
])
def test_bad_step_times_are_refused_naming_the_field(lighthouse: Callable[..., str], field: str, value: object,
                                                     says: str) -> None:
    url = lighthouse()
    body = {**qr("a"), "compute_s": 0.1, "wait_s": 0.01, field: value}
    code, answer = Client(url).call("POST", "/v1/quorum", body)
    assert code == 400 and says in answer["error"], answer


def test_a_wait_without_its_compute_is_refused(lighthouse: Callable[..., str]) -> None:
    code, answer = Client(lighthouse()).call("POST", "/v1/quorum", {**qr("a"), "wait_s": 0.01})
    assert code == 400 and "'wait_s' needs 'compute_s'" in answer["error"], answer


def test_the_policy_comes_from_the_recipe_to_the_lighthouse_and_a_bad_one_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    # ft=datacenter (llama_gpu's) reports stragglers over 50 steps; the k8s lighthouse gets the flags.
    policy = load_recipe(ROOT / "recipes" / "llama_gpu.yaml").ft.stragglers
    assert policy == StragglerPolicy("report", 2.0, 50)
    assert load_recipe(ROOT / "recipes" / "mlp.yaml").ft.stragglers.args() == []  # off: the command as before
    kinds = by_kind(manifests(str(ROOT / "recipes" / "llama_gpu.yaml"), "--replicas", "4", "--nodes-per-replica",
                              "2", "--image", "reg/img:1", "--name", "big"))
    command = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["--straggler-policy", "report", "--straggler-window", "50"], command
    assert cli_main(["lighthouse", "--port", "0", "--straggler-policy", "evict", "--straggler-factor", "1"]) == 2
    assert "factor must be a number > 1" in capsys.readouterr().err
