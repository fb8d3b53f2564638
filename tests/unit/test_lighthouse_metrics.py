"""GET /metrics and GET /events of a real lighthouse (a thread, real loopback HTTP): the Prometheus text parses with
prometheus_client's own parser, the token guards both, and what they say follows what the lighthouse saw."""

from __future__ import annotations

import http.client
import json
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_fthsdp.launch.processes import wait_for
from tests.lighthouse_thread import LighthouseThread
from tests.unit.test_lighthouse import Client, hb, lighthouse, qr

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse

TOKEN = "metrics-s3cret"


def get(url: str, path: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    """(status, content type, body) of ``GET path``."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read().decode()
    finally:
        conn.close()


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of ``/metrics``, parsed by prometheus_client: sample name -> sorted labels -> value."""
    code, content_type, text = get(url, "/metrics")
    assert code == 200 and content_type.startswith("text/plain"), (code, content_type, text[:300])
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation, f"{family.name} has no help text"
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def ask(url: str, bodies: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every replica asks for a quorum at once, each on its own connection; all must be answered the same quorum."""
    clients = {rid: Client(url, token=TOKEN) for rid in bodies}
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", bodies[rid])
    answers = [client.recv() for client in clients.values()]
    assert all(code == 200 for code, _ in answers) and len({a["quorum_id"] for _, a in answers}) == 1, answers
    return [a for _, a in answers]


def test_metrics_parse_and_follow_a_death_and_a_recovery(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2, token=TOKEN)
    beats = {rid: Client(url, token=TOKEN) for rid in "abc"}
    for rid, client in beats.items():
        assert client.call("POST", "/v1/heartbeat", hb(rid, step=0))[0] == 200
    q0 = ask(url, {rid: qr(rid, 0) for rid in "abc"})[0]["quorum_id"]
    ask(url, {rid: qr(rid, 1, q0, ("a", "b", "c"), committed_in=q0) for rid in "abc"})
    before = scrape(url)
    assert before["fthsdp_quorum_size"][()] == 3 and before["fthsdp_committed_step"][()] == 1
    assert before["fthsdp_failures_total"] == {(("kind", "crash"),): 0, (("kind", "hang"),): 0}
    assert before["fthsdp_groups"][(("state", "training"),)] == 3 and before["fthsdp_groups"][(("state", "hung"),)] == 0
    assert before["fthsdp_quorum_changes_total"][()] == 1 and before["fthsdp_step_rate"][()] > 0

    beats["c"].crash()  # c's heartbeat connection resets, as a killed process's does
    wait_for(lambda: scrape(url)["fthsdp_failures_total"][(("kind", "crash"),)] == 1, 10, "c's death counted")
    # a and b discard their attempt at step 2 (c died in its exchange) and retrain it without c.
    q1 = ask(url, {rid: qr(rid, 1, q0, ("a", "b", "c"), commit_failed=True, committed_in=q0)
                   for rid in "ab"})[0]["quorum_id"]
    after_death = scrape(url)
    assert after_death["fthsdp_quorum_size"][()] == 2 and after_death["fthsdp_groups"][(("state", "down"),)] == 1
    assert after_death["fthsdp_stall_seconds_count"][()] == 0  # the job has not committed since the death
    assert after_death["fthsdp_quorum_changes_total"][()] == 2 and after_death["fthsdp_discarded_steps_total"][()] == 2

    # a and b commit step 2: the stall ends with the job's first commit since the death.
    ask(url, {rid: qr(rid, 2, q1, ("a", "b"), committed_in=q1) for rid in "ab"})
    assert scrape(url)["fthsdp_stall_seconds_count"][()] == 1

    # c comes back (a new incarnation, from nothing) and is sent to catch up at the next step.
    beats["c"] = Client(url, token=TOKEN)  # kept open: its close would declare c dead again
    assert beats["c"].call("POST", "/v1/heartbeat", hb("c", incarnation="c-second"))[0] == 200
    bodies = {rid: qr(rid, 3, q1, ("a", "b"), committed_in=q1) for rid in "ab"}
    answer = ask(url, {"c": qr("c", 0, incarnation="c-second")} | bodies)[0]
    assert answer["catch_up_from"].get("c") in ("a", "b"), answer
    catching_up = scrape(url)
    assert catching_up["fthsdp_recovery_seconds_count"][()] == 0
    assert catching_up["fthsdp_group_lag_steps"][(("replica_id", "c"),)] == 3
    assert catching_up["fthsdp_groups"][(("state", "catching_up"),)] == 1
    assert catching_up["fthsdp_quorum_participants"][()] == 2

    # All three committed step 4 in that quorum (c loaded the state of step 3 first): c contributes again.
    q2 = answer["quorum_id"]
    bodies = {rid: qr(rid, 4, q2, ("a", "b", "c"), committed_in=q2, incarnation="c-second" if rid == "c" else None)
              for rid in "abc"}
    bodies["c"]["caught_up"] = {"source": answer["catch_up_from"]["c"], "step": 3, "bytes": 5 << 20, "fetch_s": 0.25}
    ask(url, bodies)
    done = scrape(url)
    assert done["fthsdp_recovery_seconds_count"][()] == 1 and done["fthsdp_recoveries_total"][()] == 1
    assert done["fthsdp_catch_up_seconds_count"][()] == 1 and done["fthsdp_catch_ups_total"][()] == 1
    assert done["fthsdp_recovery_seconds_bucket"][(("le", "+Inf"),)] == 1
    assert done["fthsdp_quorum_participants"][()] == 3 and done["fthsdp_committed_step"][()] == 4
    assert done["fthsdp_stall_seconds_count"][()] == 1 and done["fthsdp_catch_up_bytes_total"][()] == 5 << 20

    code, _, text = get(url, "/events")
    events = json.loads(text)
    kinds = [(e["kind"], e["replica_id"]) for e in events["events"]]
    after_death_kinds = kinds[kinds.index(("death", "c")):]
    for expected in (("rejoin", "c"), ("catch_up", "c"), ("caught_up", "c"), ("recovered", "c")):
        assert after_death_kinds.count(expected) == 1, (expected, kinds)
    discards = [e for e in events["events"] if e["kind"] == "discard"]
    assert sorted(rid for e in discards for rid in e["replica_ids"]) == ["a", "b"], discards  # each once
    (fetched,) = [e for e in events["events"] if e["kind"] == "fetched"]
    assert (fetched["replica_id"], fetched["bytes"], fetched["step"]) == ("c", 5 << 20, 3), fetched
    assert "c fetched 5.0 MiB of the state of step 3 from" in fetched["text"], fetched
    assert ("alive", "c") not in kinds, "a new incarnation's first heartbeat is its rejoin, not a revival"
    assert [q["members"] for q in events["quorums"]] == [["a", "b", "c"], ["a", "b"], ["a", "b", "c"]]
    assert [s["replica_id"] for s in events["stalls"]] == ["c"] == [r["replica_id"] for r in events["recoveries"]]
    code, _, text = get(url, f"/events?after={events['last_seq']}")
    assert code == 200 and json.loads(text)["events"] == []
    assert get(url, "/events?after=-1")[0] == 400
    assert get(url, "/events?after=%C2%B2")[0] == 400  # a superscript two: a digit to str.isdigit, not to int()
    # Each lighthouse names its event log: the page of a restarted one starts its log afresh.
    with LighthouseThread(token=TOKEN, startup_grace_ms=0) as other:
        assert json.loads(get(other, "/events")[2])["log_id"] != events["log_id"]


def test_each_answered_round_is_timed_from_its_oldest_request(lighthouse: Callable[..., str]) -> None:
    """/status's ``last_round`` and the two round histograms: the gathering runs from the oldest held request's
    arrival (a waited 0.3 s for b), and each answered round is observed once and replaces the last."""
    url = lighthouse(min_replicas=2, token=TOKEN)
    beats = {rid: Client(url, token=TOKEN) for rid in "ab"}  # kept open: a close declares the group dead
    for rid, client in beats.items():
        assert client.call("POST", "/v1/heartbeat", hb(rid))[0] == 200
    early, late = Client(url, token=TOKEN), Client(url, token=TOKEN)
    early.send("POST", "/v1/quorum", qr("a"))
    wait_for(lambda: Client(url, token=TOKEN).status()["waiting"] is not None, 5, "a's request held")
    time.sleep(0.3)  # b asks 0.3 s after a: the round's gathering took at least that long
    late.send("POST", "/v1/quorum", qr("b"))
    (code_a, answer), (code_b, _) = early.recv(), late.recv()
    assert code_a == code_b == 200
    last = Client(url, token=TOKEN).status()["last_round"]
    assert (last["quorum_id"], last["step"], last["requests"]) == (answer["quorum_id"], 0, 2), last
    assert last["gather_s"] >= 0.3 and last["age_s"] >= 0, last
    samples = scrape(url)
    assert samples["fthsdp_round_gather_seconds_count"][()] == 1 == samples["fthsdp_round_answer_seconds_count"][()]
    assert samples["fthsdp_round_gather_seconds_sum"][()] == pytest.approx(last["gather_s"], abs=1e-3)

    # The next step: both ask at once and are answered together, in the same quorum; that round replaces the last.
    q = answer["quorum_id"]
    second = ask(url, {rid: qr(rid, 1, q, ("a", "b"), committed_in=q) for rid in "ab"})[0]
    last = Client(url, token=TOKEN).status()["last_round"]
    assert (last["quorum_id"], last["step"], last["requests"]) == (second["quorum_id"], 1, 2), last
    assert scrape(url)["fthsdp_round_gather_seconds_count"][()] == 2


def test_the_page_never_inserts_data_as_markup() -> None:
    """Every value (a replica id, a checkpoint path, an error) reaches the page through textContent or an
    attribute: the page has no sink that parses a string as HTML."""
    page = (resources.files("lightning_fthsdp.lighthouse") / "dashboard.html").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in page, sink
    assert "textContent" in page


def test_a_malformed_catch_up_report_is_refused_naming_the_field(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(token=TOKEN)
    for report, field in (({"source": "a", "step": 1, "bytes": -1, "fetch_s": 1.0}, "'bytes'"),
                          ({"source": "a b", "step": 1, "bytes": 1, "fetch_s": 1.0}, "caught_up.source"),
                          ({"source": "a", "step": 1, "bytes": 1, "fetch_s": float("nan")}, "'fetch_s'"),
                          ("fast", "'caught_up'")):
        body = qr("x", 0) | {"caught_up": report}
        code, answer = Client(url, token=TOKEN).call("POST", "/v1/quorum", raw=json.dumps(body).encode())
        assert code == 400 and field in answer["error"], (report, answer)


def test_the_token_guards_metrics_and_events(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(token=TOKEN)
    for path in ("/metrics", "/events", "/status"):
        assert get(url, path, token=None)[0] == 401, path
        assert get(url, path, token="wrong")[0] == 401, path
        assert get(url, path)[0] == 200, path


def test_metrics_without_prometheus_client_answer_501_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lighthouse in an install that lacks prometheus_client runs on; /metrics says what to install."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes its import fail
    monkeypatch.delitem(sys.modules, "lightning_fthsdp.lighthouse.metrics")
    with LighthouseThread() as url:
        code, _, body = get(url, "/metrics", token=None)
        assert code == 501 and "pip install prometheus_client" in body, body
        assert get(url, "/status", token=None)[0] == 200
