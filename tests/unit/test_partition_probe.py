"""Groups cut off from each other while all reach the lighthouse: the probe after a failed exchange, the fewest groups
kept out, and an excluded group admitted again once it reaches its peers (``lighthouse.exclusions``)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.exclusions import MAX_PROBE_TARGETS, fewest_to_exclude, probe_peers, unreachable_pairs
from lightning_fthsdp.manager.probe import unreachable
from tests.unit.test_lighthouse import Client, form, hb, lighthouse, qr

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse


def pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def test_one_cut_pair_keeps_out_one_group_the_one_behind_or_sorting_last() -> None:
    assert fewest_to_exclude({pair("a", "b")}, {"a": 5, "b": 5}) == {"b"}
    assert fewest_to_exclude({pair("a", "b")}, {"a": 4, "b": 5}) == {"a"}  # b holds more of the job's work


def test_a_group_cut_from_all_others_is_the_one_kept_out() -> None:
    pairs = {pair("a", "b"), pair("a", "c"), pair("a", "d")}
    assert fewest_to_exclude(pairs, {}) == {"a"}


def test_two_cut_pairs_keep_out_two_groups_and_a_triangle_two() -> None:
    assert fewest_to_exclude({pair("a", "b"), pair("c", "d")}, {}) == {"b", "d"}
    assert len(fewest_to_exclude({pair("a", "b"), pair("b", "c"), pair("a", "c")}, {})) == 2


def test_many_groups_fall_back_to_a_greedy_cover_that_still_covers_every_pair() -> None:
    hub_pairs = {pair("hub", f"g{i:02d}") for i in range(40)} | {pair(f"g{i:02d}", f"h{i:02d}") for i in range(5)}
    cover = fewest_to_exclude(hub_pairs, {})
    assert all(p & cover for p in hub_pairs) and "hub" in cover and len(cover) == 6


def test_every_member_probes_every_other_in_a_small_quorum_and_its_neighbours_in_a_large_one() -> None:
    small = [f"g{i}" for i in range(MAX_PROBE_TARGETS + 1)]
    assert set(probe_peers(small, 3)) == set(small) - {"g3"}
    large = [f"g{i:05d}" for i in range(12_500)]
    peers = probe_peers(large, 0)
    assert 32 <= len(peers) == len(set(peers)) <= MAX_PROBE_TARGETS and "g00000" not in peers
    assert {"g00001", "g12499", "g00016", "g12484", "g04096"} <= set(peers)
    # Each pair of neighbours is probed from both sides: a cut between them is reported whichever probes.
    assert all(large[0] in probe_peers(large, large.index(p)) for p in peers)


def test_pairs_only_among_candidates_and_one_way_reports_count() -> None:
    reports = {"a": ("b", "z"), "c": ("a",), "x": ("a",)}
    assert unreachable_pairs(reports, ["a", "b", "c"]) == {pair("a", "b"), pair("a", "c")}


def test_probe_tells_a_listening_and_a_refusing_host_from_a_silent_one() -> None:
    with contextlib.ExitStack() as stack:
        listening = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        closed = stack.enter_context(socket.socket())
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, the host answered
        # A listener whose accept queue is full drops further SYNs without an answer, as a cut link does.
        silent = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
        for _ in range(4):
            filler = stack.enter_context(socket.socket())
            filler.settimeout(0.2)
            with contextlib.suppress(OSError):
                filler.connect(silent.getsockname())
        targets = {"up": f"http://127.0.0.1:{listening.getsockname()[1]}",
                   "gone": f"http://127.0.0.1:{closed.getsockname()[1]}",
                   "cut": f"http://127.0.0.1:{silent.getsockname()[1]}", "junk": "not an address"}
        assert unreachable(targets, timeout_s=0.3) == ["cut", "junk"]


def answer(client: Client, body: dict[str, Any]) -> tuple[int, Any]:
    return client.call("POST", "/v1/quorum", body)


def test_a_cut_between_two_members_keeps_one_out_until_it_reaches_the_other_again(
        lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    beats = {rid: Client(url) for rid in "abc"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    first = form(url, "a", "b", "c")[0]
    qid = first["quorum_id"]
    clients = {rid: Client(url) for rid in "abc"}
    # Every member's exchange failed while every member lived: each is asked to probe the others first.
    for rid, client in clients.items():
        code, body = answer(client, qr(rid, step=0, quorum_id=qid, members=tuple("abc"), commit_failed=True,
                                       probed=False, exchange_failed=True))
        assert code == 200 and body["probe"] == {o: f"http://{o}:1" for o in "abc" if o != rid}, body
    # a and b cannot reach each other; c reaches both: b (sorting last, at the same step) is kept out.
    reports = {"a": ("b",), "b": ("a",), "c": ()}
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", qr(rid, step=0, quorum_id=qid, members=tuple("abc"), commit_failed=True,
                                             unreachable=reports[rid]))
    got = {rid: client.recv() for rid, client in clients.items()}
    assert got["b"][1]["excluded"]["reason"] == "partition" and got["b"][1]["probe"] == {"a": "http://a:1"}, got["b"]
    assert [m["replica_id"] for m in got["a"][1]["members"]] == ["a", "c"] == \
        [m["replica_id"] for m in got["c"][1]["members"]]
    status = clients["c"].status()
    assert set(status["excluded"]) == {"b"} and next(g for g in status["groups"] if g["replica_id"] == "b")[
        "state"] == "excluded" and not next(g for g in status["groups"] if g["replica_id"] == "b")["dead"]
    # Still cut: its request is held a probe interval (the heartbeat timeout, or its own timeout if shorter) and
    # answered with a to probe again.
    start = time.monotonic()
    code, body = answer(clients["b"], qr("b", step=0, commit_failed=True, unreachable=("a",), timeout_ms=1_000))
    assert code == 200 and body["excluded"]["peers"] == ["a"] and time.monotonic() - start >= 0.9
    # Healed: admitted, and the next round takes it in, behind, catching up.
    second = got["a"][1]["quorum_id"]
    clients["b"].send("POST", "/v1/quorum", qr("b", step=0, commit_failed=True, unreachable=()))
    for rid in "ac":
        clients[rid].send("POST", "/v1/quorum", qr(rid, step=1, quorum_id=second, members=("a", "c"),
                                                   committed_in=second))
    rejoined = {rid: client.recv() for rid, client in clients.items()}
    assert all(code == 200 for code, _ in rejoined.values()), rejoined
    assert [m["replica_id"] for m in rejoined["b"][1]["members"]] == ["a", "b", "c"]
    assert rejoined["b"][1]["catch_up_from"] == {"b": "a"} and clients["c"].status()["excluded"] == {}
    kinds = [e["kind"] for e in clients["c"].call("GET", "/events")[1]["events"]]
    assert "exclude" in kinds and "readmit" in kinds


def test_a_failed_exchange_after_a_death_asks_for_no_probe(lighthouse: Callable[..., str]) -> None:
    """A crash explains the failure: the survivors' requests go straight to the next quorum (no added stall)."""
    url = lighthouse(min_replicas=2)
    beats = {rid: Client(url) for rid in "abc"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    qid = form(url, "a", "b", "c")[0]["quorum_id"]
    beats["c"].crash()
    survivors = {rid: Client(url) for rid in "ab"}
    wait_for(lambda: next(g for g in survivors["a"].status()["groups"] if g["replica_id"] == "c")["dead"], 10,
             "the lighthouse declaring c dead")
    for rid, client in survivors.items():
        client.send("POST", "/v1/quorum", qr(rid, quorum_id=qid, members=tuple("abc"), commit_failed=True,
                                             probed=False, exchange_failed=True))
    got = {rid: client.recv() for rid, client in survivors.items()}
    assert all(code == 200 and "probe" not in body for code, body in got.values()), got
    assert [m["replica_id"] for m in got["a"][1]["members"]] == ["a", "b"]


@pytest.mark.parametrize("bad", [["a"] * 65, "b", [7]])
def test_a_bad_unreachable_field_is_refused_naming_it(lighthouse: Callable[..., str], bad: object) -> None:
    url = lighthouse()
    code, body = answer(Client(url), {**qr("a"), "unreachable": bad})
    assert code == 400 and "unreachable" in body["error"], body


def test_a_report_counts_only_for_the_members_a_group_was_asked_to_probe(lighthouse: Callable[..., str]) -> None:
    """A stale or forged report naming a group outside the requester's probe (here: itself and a stranger) excludes
    nobody; without a failed collective no probe is asked for at all."""
    url = lighthouse(min_replicas=2)
    beats = {rid: Client(url) for rid in "abc"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    qid = form(url, "a", "b", "c")[0]["quorum_id"]
    clients = {rid: Client(url) for rid in "abc"}
    reports = {"a": ("a", "zed"), "b": (), "c": ()}
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", qr(rid, step=1, quorum_id=qid, members=tuple("abc"), committed_in=qid,
                                             unreachable=reports[rid]))
    got = {rid: client.recv() for rid, client in clients.items()}
    assert all(code == 200 and len(body["members"]) == 3 for code, body in got.values()), got
    assert clients["a"].status()["excluded"] == {}
