"""The lighthouse server over real loopback HTTP connections (a LighthouseThread, and one real subprocess)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lightning_fthsdp.cli import main as cli_main
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.news import REVIVAL_NEWS_S
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.membership.client import Heartbeat
from lightning_fthsdp.membership.member import MemberHeartbeat
from lightning_fthsdp.membership.relay import GroupRelay
from lightning_fthsdp.protocol.quorum import Member, Quorum
from tests.lighthouse_thread import LighthouseThread

LISTENING = re.compile(r"^fthsdp lighthouse listening on (http://[\d.]+:(\d+)) store ([\d.]+:\d+)$")


class Client:
    """One keep-alive connection; ``send`` then ``recv`` lets a test hold several requests in flight at once."""

    def __init__(self, url: str, token: str | None = None) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        self.token = token

    def send(self, method: str, path: str, body: object = None, raw: bytes | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        self.conn.request(method, path, body=data, headers=headers)

    def recv(self) -> tuple[int, Any]:
        response = self.conn.getresponse()
        payload = response.read()
        if response.getheader("Content-Type", "").startswith("text/html"):
            return response.status, payload.decode()
        return response.status, json.loads(payload)

    def call(self, method: str, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, Any]:
        self.send(method, path, body, raw)
        return self.recv()

    def status(self) -> dict[str, Any]:
        code, body = self.call("GET", "/status")
        assert code == 200, body
        return body

    def crash(self) -> None:
        """Close abruptly (RST), as a killed process's socket does: no leave, no clean shutdown."""
        sock = self.conn.sock
        assert sock is not None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def hb(rid: str, epoch: int = -1, wait_ms: int = 0, step: int = 0, shard_count: int = 2, rank: int = 0,
       incarnation: str | None = None) -> dict[str, Any]:
    return {"replica_id": rid, "incarnation": incarnation or inc(rid), "rank": rank, "step": step,
            "shard_count": shard_count, "known_epoch": epoch, "wait_ms": wait_ms}


def qr(rid: str, step: int = 0, quorum_id: int = -1, members: tuple[str, ...] = (), commit_failed: bool = False,
       timeout_ms: int = 10_000, shard_count: int = 2, committed_in: int = -1,
       incarnation: str | None = None, unreachable: tuple[str, ...] | None = None,
       probed: bool = True, exchange_failed: bool = False, rendezvous_failed: bool = False) -> dict[str, Any]:
    """A quorum request. One reporting a failed commit says it probed the members and reached them all (unless
    ``unreachable`` says otherwise, or ``probed`` is False): the lighthouse asks for that probe first (see
    test_partition_probe)."""
    if commit_failed and probed and unreachable is None:
        unreachable = ()
    return {"replica_id": rid, "incarnation": incarnation or inc(rid), "step": step, "shard_count": shard_count,
            "address": f"http://{rid}:1", "commit_failed": commit_failed, "quorum_id": quorum_id,
            "members": list(members),
            "committed_in": committed_in, "following": False, "timeout_ms": timeout_ms,
            "unreachable": None if unreachable is None else list(unreachable)} | (
                {"exchange_failed": True} if exchange_failed else {}) | (
                {"rendezvous_failed": True} if rendezvous_failed else {})


def inc(rid: str) -> str:
    """The incarnation a test's replica ``rid`` speaks as (one per replica unless a test restarts it)."""
    return f"{rid}-first"


def leave(rid: str, rank: int = 0, incarnation: str | None = None) -> dict[str, Any]:
    return {"replica_id": rid, "rank": rank, "incarnation": incarnation or inc(rid)}


def replica(status: dict[str, Any], rid: str) -> dict[str, Any]:
    return next(r for r in status["groups"] if r["replica_id"] == rid)


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., str]]:
    """Start a lighthouse thread (port 0 unless given); all are stopped after the test."""
    with contextlib.ExitStack() as stack:
        def start(min_replicas: int = 1, join_timeout_ms: int = 10_000, heartbeat_timeout_ms: int = 30_000,
                  lost_state_wait_ms: int = 10_000, **kw: Any) -> str:
            rules = QuorumRules(min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                lost_state_wait_ms=lost_state_wait_ms)
            kw.setdefault("startup_grace_ms", 0)  # a test's lighthouse replaces none: its groups may ask at once
            return stack.enter_context(LighthouseThread(rules=rules, heartbeat_timeout_ms=heartbeat_timeout_ms, **kw))
        yield start


def form(url: str, *rids: str, **kw: Any) -> list[dict[str, Any]]:
    """Every replica in ``rids`` requests at once on its own connection; all must get the same quorum."""
    clients = [Client(url) for _ in rids]
    for client, rid in zip(clients, rids, strict=True):
        client.send("POST", "/v1/quorum", qr(rid, **kw))
    answers = [client.recv() for client in clients]
    assert all(code == 200 for code, _ in answers), answers
    assert len({a["quorum_id"] for _, a in answers}) == 1
    return [a for _, a in answers]


def test_a_member_holding_another_state_of_the_same_step_recovers_from_the_others(
        lighthouse: Callable[..., str]) -> None:
    """b committed step 5 in quorum 3, a and c trained step 5 again in quorum 4: b must take their state."""
    url = lighthouse(min_replicas=3)
    clients = {rid: Client(url) for rid in "abc"}
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", qr(rid, 5, committed_in=3 if rid == "b" else 4))
    answers = [client.recv() for client in clients.values()]
    assert all(code == 200 and answer == answers[0][1] for code, answer in answers), answers
    assert answers[0][1]["catch_up_from"] == {"b": "a"} and answers[0][1]["max_step"] == 5


def test_two_groups_form_a_quorum_then_a_third_joins(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    obs = Client(url)
    a, b = form(url, "a", "b")
    assert a["quorum_id"] == 0 and [m["replica_id"] for m in a["members"]] == ["a", "b"]
    assert a["store"] == obs.status()["store"] and a["shard_count"] == 2 and a["addresses"] == {}  # none catches up
    hc = Client(url)  # kept open: closing it would declare c dead
    assert hc.call("POST", "/v1/heartbeat", hb("c"))[0] == 200
    qc = Client(url)
    qc.send("POST", "/v1/quorum", qr("c", 0))
    wait_for(lambda: replica(obs.status(), "c")["pending"], 5, "c pending", interval_s=0.005)
    a, b = form(url, "a", "b", step=1, quorum_id=0, members=("a", "b"), committed_in=0)
    code, c = qc.recv()
    assert code == 200 and c == a == b
    assert c["quorum_id"] == 1 and c["max_step"] == 1 and c["catch_up_from"] == {"c": "a"}
    # c's source and its alternative, to every member alike
    assert c["addresses"] == {"a": "http://a:1", "b": "http://b:1"}
    status = obs.status()
    assert status["members"] == ["a", "b", "c"] and status["catch_up_from"] == [{"replica_id": "c", "source": "a"}]
    # Heartbeats tell every rank of a member its place in the newest quorum (to start its rendezvous early), and
    # tell a non-member none.
    code, beat = hc.call("POST", "/v1/heartbeat", hb("c"))
    assert code == 200 and (beat["quorum_id"], beat["quorum_rank"], beat["quorum_size"]) == (1, 2, 3)
    assert beat["store"] == status["store"]
    code, beat = Client(url).call("POST", "/v1/heartbeat", hb("d"))
    assert code == 200 and beat["quorum_id"] == 1 and "quorum_rank" not in beat
    # c leaves and a new process of it heartbeats: quorum 1 was not answered to it, it must ask.
    assert Client(url).call("POST", "/v1/leave", leave("c"))[0] == 200
    code, beat = hc.call("POST", "/v1/heartbeat", hb("c"))
    assert code == 200 and beat["quorum_id"] == 1 and "quorum_rank" not in beat


def test_crash_is_declared_at_once_and_wakes_the_survivors_long_poll(lighthouse: Callable[..., str]) -> None:
    url = lighthouse()
    obs, ha, hb_ = Client(url), Client(url), Client(url)
    ha.call("POST", "/v1/heartbeat", hb("a"))
    code, answer = hb_.call("POST", "/v1/heartbeat", hb("b"))
    assert code == 200 and answer["dead"] == [] and answer["quorum_id"] == -1
    epoch = answer["epoch"]
    hb_.send("POST", "/v1/heartbeat", hb("b", epoch, wait_ms=5_000))
    obs.status()  # processed after b's long-poll arrived: the poll is held now
    start = time.monotonic()
    ha.crash()
    code, answer = hb_.recv()
    elapsed = time.monotonic() - start
    assert code == 200 and answer["dead"] == ["a"] and answer["epoch"] == epoch + 1, answer
    assert elapsed < 0.2, f"crash took {elapsed:.3f} s to reach the survivor"
    assert replica(obs.status(), "a")["dead"]
    # The dead replica heartbeats again: revived, no new epoch (nobody is woken), and out of the dead list soon after.
    revived = Client(url)
    assert revived.call("POST", "/v1/heartbeat", hb("a", epoch + 1))[0] == 200
    assert not replica(obs.status(), "a")["dead"]
    time.sleep(2 * REVIVAL_NEWS_S)
    code, answer = revived.call("POST", "/v1/heartbeat", hb("a", epoch + 1))
    assert answer["dead"] == [] and answer["epoch"] == epoch + 1


def test_a_replaced_heartbeat_connection_declares_nothing(lighthouse: Callable[..., str]) -> None:
    url = lighthouse()
    obs, old, new = Client(url), Client(url), Client(url)
    old.call("POST", "/v1/heartbeat", hb("a"))
    new.call("POST", "/v1/heartbeat", hb("a"))
    old.crash()
    old_epoch = obs.status()["epoch"]
    new.call("POST", "/v1/heartbeat", hb("a"))  # a round trip on the loop after the close was processed
    status = obs.status()
    assert not replica(status, "a")["dead"] and status["epoch"] == old_epoch
    assert replica(status, "a")["deaths"] == 0  # (a revival would leave the epoch as it was: the count tells)
    new.crash()
    wait_for(lambda: replica(obs.status(), "a")["dead"], 5, "a declared dead", interval_s=0.005)


def test_hang_is_detected_by_heartbeat_expiry(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(heartbeat_timeout_ms=300)
    ha, hb_ = Client(url), Client(url)
    ha.call("POST", "/v1/heartbeat", hb("a"))
    start = time.monotonic()
    epoch = hb_.call("POST", "/v1/heartbeat", hb("b"))[1]["epoch"]
    # b keeps heartbeating (long-polls of 100 ms pace it); a goes silent but keeps its connection open.
    while True:
        assert time.monotonic() - start < 3, "a was never declared dead"
        answer = hb_.call("POST", "/v1/heartbeat", hb("b", epoch, wait_ms=100))[1]
        if answer["epoch"] != epoch:
            break
    elapsed = time.monotonic() - start
    assert answer["dead"] == ["a"] and 0.3 <= elapsed < 1.0, (answer, elapsed)
    assert not replica(Client(url).status(), "b")["dead"]


def test_leave_forgets_the_replica_and_lets_the_rest_decide(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(replica_ids=["a", "b"])  # declared: a counts towards the majority while it only heartbeats
    obs, ha = Client(url), Client(url)  # ha stays open: its close would declare a dead
    ha.call("POST", "/v1/heartbeat", hb("a"))
    qb = Client(url)
    qb.send("POST", "/v1/quorum", qr("b"))  # 1 of 2 alive: no majority yet
    wait_for(lambda: replica(obs.status(), "b")["pending"], 5, "b pending", interval_s=0.005)
    epoch = obs.status()["epoch"]
    assert Client(url).call("POST", "/v1/leave", leave("a")) == (200, {})
    code, answer = qb.recv()
    assert code == 200 and [m["replica_id"] for m in answer["members"]] == ["b"]
    status = obs.status()
    assert [r["replica_id"] for r in status["groups"]] == ["b"] and status["epoch"] == epoch + 1  # the leave only
    code, answer = obs.call("POST", "/v1/leave", leave("a"))
    assert code == 404 and "'a'" in answer["error"]


def test_quorum_request_times_out_with_504_and_is_dropped(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    start = time.monotonic()
    code, answer = Client(url).call("POST", "/v1/quorum", qr("a", timeout_ms=200))
    assert code == 504 and "timeout_ms=200" in answer["error"] and time.monotonic() - start >= 0.2
    assert not replica(Client(url).status(), "a")["pending"]


def test_a_client_that_disconnects_is_dropped_from_pending(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    obs, qa = Client(url), Client(url)
    qa.send("POST", "/v1/quorum", qr("a"))
    wait_for(lambda: replica(obs.status(), "a")["pending"], 5, "a pending", interval_s=0.005)
    qa.crash()
    wait_for(lambda: not replica(obs.status(), "a")["pending"], 5, "a dropped", interval_s=0.005)


def test_join_timeout_answers_without_a_silent_straggler(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(join_timeout_ms=300, replica_ids="abc")  # declared: c is expected although it only heartbeats
    heartbeats = [Client(url) for _ in "abc"]  # kept open: closing one declares its replica dead
    for client, rid in zip(heartbeats, "abc", strict=True):
        client.call("POST", "/v1/heartbeat", hb(rid))
    start = time.monotonic()
    answers = form(url, "a", "b")
    assert [m["replica_id"] for m in answers[0]["members"]] == ["a", "b"] and time.monotonic() - start >= 0.3


def test_status_and_html_page(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(token="s3cret")
    obs = Client(url, token="s3cret")
    obs.call("POST", "/v1/heartbeat", hb("a", step=4))
    status = obs.status()
    assert set(status) == {"quorum_id", "epoch", "max_step", "committed_step", "lost_steps", "checkpoint", "waiting",
                           "min_replicas", "participants", "step_rate",
                           "declared", "members", "groups", "catch_up_from", "excluded", "stragglers", "store",
                           "uptime_s", "lighthouse_lag", "last_round"}
    assert status["last_round"] is None  # no quorum request answered yet
    assert status["max_step"] == 4 and status["quorum_id"] == -1 and status["min_replicas"] == 1
    assert status["committed_step"] == -1 and status["lost_steps"] == [] and status["declared"] is None
    assert status["participants"] == 0 and status["step_rate"] == 0
    assert replica(status, "a") | {"heartbeat_age_s": 0} == {
        "replica_id": "a", "step": 4, "alive": True, "dead": False, "heartbeat_age_s": 0, "in_quorum": False,
        "pending": False, "state": "waiting", "lag": 0, "incarnations": 1, "deaths": 0, "cause": "",
        "heartbeat_connections": 1, "connections": 1, "lost_ranks": [], "step_time_s": None, "waited_for_s": 0.0,
        "straggler": False}
    code, page = obs.call("GET", "/")
    # The page is static; its script renders what /status and /events say (tests/browser checks it in Chromium).
    assert code == 200 and "<h1>fthsdp lighthouse</h1>" in page and 'getJSON("/status")' in page
    code, events = obs.call("GET", "/events")
    assert code == 200 and [(e["kind"], e["replica_id"]) for e in events["events"]] == [("join", "a")]
    assert Client(url).call("GET", "/")[0] == 401


def snapshot(client: Client) -> dict[str, Any]:
    status = client.status()
    for r in status["groups"]:
        del r["heartbeat_age_s"]
    del status["uptime_s"]
    if status["last_round"] is not None:
        del status["last_round"]["age_s"]  # the time since it, as uptime_s
    return status


BAD_REQUESTS = [
    ("POST", "/v1/heartbeat", b"{not json", 400, "JSON"),
    ("POST", "/v1/heartbeat", b"[1]", 400, "JSON object"),
    ("POST", "/v1/heartbeat", {k: v for k, v in hb("a").items() if k != "known_epoch"}, 400, "'known_epoch'"),
    ("POST", "/v1/heartbeat", hb("a") | {"step": "3"}, 400, "'step'"),
    ("POST", "/v1/heartbeat", hb("a") | {"step": True}, 400, "'step'"),
    ("POST", "/v1/heartbeat", hb("a", step=-1), 400, "'step'"),
    ("POST", "/v1/heartbeat", hb("a") | {"wait_ms": -5}, 400, "'wait_ms'"),
    ("POST", "/v1/heartbeat", hb("a b"), 400, "replica_id"),
    ("POST", "/v1/heartbeat", hb("z", shard_count=3), 409, "shard_count 3"),
    ("POST", "/v1/quorum", qr("a", timeout_ms=0), 400, "'timeout_ms'"),
    ("POST", "/v1/quorum", qr("a", members=("ok", "no way")), 400, "'members'"),
    ("POST", "/v1/quorum", qr("a") | {"members_digest": 5}, 400, "'members_digest'"),
    ("POST", "/v1/quorum", qr("a") | {"members_digest": "f" * 65}, 400, "'members_digest'"),
    # A quorum 0 of which this lighthouse, not settled yet, knows no member list by that digest: it needs the members.
    ("POST", "/v1/quorum", qr("a", 1, quorum_id=0, committed_in=0) | {"members_digest": "f" * 32}, 428,
     "sent no 'members'"),
    ("POST", "/v1/quorum", qr("a") | {"commit_failed": 1}, 400, "'commit_failed'"),
    ("POST", "/v1/quorum", qr("a", committed_in=-2), 400, "'committed_in'"),
    ("POST", "/v1/quorum", qr("a") | {"following": "no"}, 400, "'following'"),
    ("POST", "/v1/quorum", qr("a", shard_count=4), 409, "shard_count 2 of the current quorum 0"),
    ("POST", "/v1/leave", leave("zz"), 404, "'zz'"),
    ("POST", "/v1/leave", {}, 400, "'replica_id'"),
    ("GET", "/v1/heartbeat", None, 405, "takes POST"),
    ("GET", "/nope", None, 404, "'/nope'"),
    ("POST", "/v1/heartbeat", b"x" * ((1 << 20) + 1), 413, "limit"),
    ("POST", "/v1/heartbeat", b"[" * 100_000 + b"]" * 100_000, 400, "RecursionError"),
]


def test_every_bad_request_is_refused_and_changes_nothing(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2, token="tok")
    form_clients = [Client(url, token="tok") for _ in "ab"]
    for client, rid in zip(form_clients, "ab", strict=True):
        client.send("POST", "/v1/quorum", qr(rid))
    assert [c.recv()[0] for c in form_clients] == [200, 200]
    client = Client(url, token="tok")  # one keep-alive connection serves every bad request and the checks
    before = snapshot(client)
    for method, path, body, code, needle in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        got, answer = client.call(method, path, None if raw else body, raw)
        assert (got, needle in answer.get("error", "")) == (code, True), (path, raw[:20] if raw else body, answer)
        assert snapshot(client) == before, f"state changed after {path} {body!r:.60}"
    for token in (None, "wrong"):
        got, answer = Client(url, token=token).call("POST", "/v1/heartbeat", hb("a"))
        assert got == 401 and "token" in answer["error"]
    assert snapshot(client) == before


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` as raw bytes on a fresh connection; everything the lighthouse answers until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(("request_bytes", "status", "needle"), [
    (b"GET /sta\rtus HTTP/1.1\r\nHost: x\r\n\r\n", b"400", b"control character"),
    (b"GET /status HTTP/1.1\r\nHost: x\x00y\r\n\r\n", b"400", b"control character"),
    (b"POST /v1/leave HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}", b"400", b"given twice"),
    (b"POST /v1/leave HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", b"400", b"given twice"),
    (b"GET /status HTTP/1.1\r\nX-Pad: " + b"a" * (70 << 10) + b"\r\n\r\n", b"431", b"over 65536 bytes"),
], ids=["CR in the path", "NUL in a header", "two Content-Lengths", "the same Content-Length twice",
        "a 70 KiB head in one packet"])
def test_a_head_another_parser_could_read_differently_is_refused_and_the_connection_closed(
        lighthouse: Callable[..., str], request_bytes: bytes, status: bytes, needle: bytes) -> None:
    url = lighthouse(min_replicas=1)
    answer = raw_exchange(url, request_bytes)  # returns only once the lighthouse closed the connection
    assert answer.startswith(b"HTTP/1.1 " + status) and needle in answer, answer[:300]
    assert Client(url).status()["members"] == []  # nothing was served or changed, and it serves on


def test_shard_count_conflict_with_pending_requests(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    qa = Client(url)
    qa.send("POST", "/v1/quorum", qr("a", shard_count=2))
    wait_for(lambda: replica(Client(url).status(), "a")["pending"], 5, "a pending", interval_s=0.005)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("b", shard_count=8))
    assert code == 409 and "shard_count 8" in answer["error"] and "shard_count 2" in answer["error"]


def test_restarted_lighthouse_keeps_the_quorum_id(lighthouse: Callable[..., str]) -> None:
    first = LighthouseThread(rules=QuorumRules(min_replicas=2), heartbeat_timeout_ms=30_000, startup_grace_ms=0)
    with first as url:
        assert form(url, "a", "b")[0]["quorum_id"] == 0
        answer = form(url, "a", "b", step=1, quorum_id=0, members=("a", "b"), commit_failed=True, committed_in=0)[0]
    assert answer["quorum_id"] == 1
    port = urlsplit(url).port
    url2 = lighthouse(min_replicas=2, port=port)
    assert urlsplit(url2).port == port
    again = form(url2, "a", "b", step=2, quorum_id=1, members=("a", "b"))[0]
    assert again["quorum_id"] == 1 and again["max_step"] == 2


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--min-replicas", "0"], "--min-replicas"), (["--heartbeat-timeout-ms", "-1"], "heartbeat"),
                         (["--join-timeout-ms", "x"], "join"), (["--port", "70000"], "--port")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["lighthouse", *argv])
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_cli_subprocess_listens_serves_and_exits_on_sigterm() -> None:
    """Also: started at a soft open-files limit of 256 (many systems start a process at 1,024), it raises that to the
    hard limit, since it holds a connection per group."""
    env = {**os.environ, "FTHSDP_TOKEN": "from-env"}
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", "--min-replicas", "1",
         "--join-timeout-ms", "1000", "--heartbeat-timeout-ms", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the lighthouse printed no listening line within 60 s"
        line = proc.stdout.readline().strip()
        match = LISTENING.match(line)
        assert match, line
        url, store = match.group(1), match.group(3)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft_now = re.search(r"^Max open files\s+(\d+|unlimited)", limits, re.MULTILINE)
        assert soft_now and soft_now.group(1) == (str(hard) if hard != resource.RLIM_INFINITY else "unlimited"), limits
        assert Client(url).call("GET", "/status")[0] == 401
        code, answer = Client(url, token="from-env").call("POST", "/v1/quorum", qr("solo"))
        assert code == 200 and answer["store"] == store and answer["members"][0]["replica_id"] == "solo"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "quorum 0: members solo step 0" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_the_heartbeat_reports_once_that_the_lighthouse_went_away() -> None:
    """What abandons a rendezvous on the store of a lighthouse that died: the heartbeat thread's ``on_lost``, once
    per loss, not on every failed heartbeat after it."""
    timeouts = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=1_000, collective_timeout_ms=2_000,
                        quorum_timeout_ms=3_000, connect_timeout_ms=4_000, join_timeout_ms=1_000)
    losses: list[float] = []
    with LighthouseThread(rules=QuorumRules(min_replicas=1), heartbeat_timeout_ms=1_000, startup_grace_ms=0) as url:
        beat = Heartbeat(url, None, "a", inc("a"), 0, 1, timeouts, step=lambda: 0, on_dead=lambda dead: None,
                         on_lost=lambda store: losses.append(time.monotonic()), on_quorum=lambda *_: None)
        beat.start()
        assert beat.lease_valid(0), "the lighthouse never acknowledged a heartbeat"
    try:
        wait_for(lambda: losses, 10, "the heartbeat to report the lost lighthouse")
        beats_after = 10 * timeouts.heartbeat_interval_ms / 1000
        wait_for(lambda: time.monotonic() - losses[0] > beats_after, 10, "more failed heartbeats")
        assert len(losses) == 1
    finally:
        beat.leave()


def test_every_rank_learns_each_new_quorum_once_from_its_heartbeat(lighthouse: Callable[..., str]) -> None:
    """What a rank that missed its leader's relay starts early rendezvous from: each member's heartbeat reports a
    quorum with its first answer after the quorum is decided (no held heartbeat is woken for it: the epoch stays),
    once, with the member's rank; the same quorum answered again each step is not news."""
    url = lighthouse(min_replicas=2)
    timeouts = Timeouts(heartbeat_interval_ms=200, heartbeat_timeout_ms=30_000, collective_timeout_ms=40_000,
                        quorum_timeout_ms=50_000, connect_timeout_ms=60_000, join_timeout_ms=1_000)
    seen: list[tuple[str, int, int, int]] = []
    beats = [Heartbeat(url, None, rid, inc(rid), 0, 2, timeouts, step=lambda: 0, on_dead=lambda dead: None,
                       on_lost=lambda _: None,
                       on_quorum=lambda q, rank, size, store, rid=rid: seen.append((rid, q, rank, size)))
             for rid in "abc"]
    try:
        for beat in beats[:2]:
            beat.start()
        store = form(url, "a", "b")[0]["store"]
        wait_for(lambda: len(seen) == 2, 10, "a's and b's heartbeats to report quorum 0")
        form(url, "a", "b", step=1, quorum_id=0, members=("a", "b"), committed_in=0)  # the same quorum again
        epoch = Client(url).status()["epoch"]
        beats[2].start()
        joining = Client(url)
        joining.send("POST", "/v1/quorum", qr("c", 0))
        wait_for(lambda: replica(Client(url).status(), "c")["pending"], 10, "c's request to be held")
        form(url, "a", "b", step=2, quorum_id=0, members=("a", "b"), committed_in=0)
        assert joining.recv()[0] == 200
        wait_for(lambda: len(seen) == 5, 10, "every heartbeat to report quorum 1")
        assert sorted(seen) == [("a", 0, 0, 2), ("a", 1, 0, 3), ("b", 0, 1, 2), ("b", 1, 1, 3), ("c", 1, 2, 3)]
        status = Client(url).status()
        assert status["quorum_id"] == 1 and status["epoch"] == epoch
        assert store == status["store"]
    finally:
        for beat in beats:
            if beat.started:
                beat.leave()


def test_a_leader_relays_its_quorum_answer_to_its_ranks_at_once(lighthouse: Callable[..., str]) -> None:
    """How a group's other ranks learn a new quorum as it is decided (the lighthouse wakes no held heartbeat for it):
    the leader tells them its own quorum answer. A quorum the lighthouse never decided shows that path alone; older
    news, from the leader or from a heartbeat answer, is no news."""
    url = lighthouse()
    timeouts = Timeouts(heartbeat_interval_ms=200, heartbeat_timeout_ms=30_000, collective_timeout_ms=40_000,
                        quorum_timeout_ms=50_000, connect_timeout_ms=60_000, join_timeout_ms=1_000)
    seen: dict[int, list[tuple[int, int, int, str]]] = {0: [], 1: []}
    relay = GroupRelay("127.0.0.1", None, inc("a"), timeouts)
    leader = Heartbeat(url, None, "a", inc("a"), 0, 2, timeouts, step=lambda: 0, on_dead=lambda dead: None,
                       on_lost=lambda _: None, on_quorum=lambda *news: seen[0].append(news), relay=relay)
    member = MemberHeartbeat(relay.address, None, "a", inc("a"), 1, timeouts, on_dead=lambda dead: None,
                             on_lost=lambda _: None, on_quorum=lambda *news: seen[1].append(news))
    try:
        leader.start()
        member.start()
        wait_for(lambda: member.membership.state == "ok", 10, "the member's first relayed heartbeat answer")
        members = (Member("b", 3, "b:1"), Member("a", 3, "a:1"))
        leader.quorum_answered(Quorum(41, members, 3, 2), "store:9")
        wait_for(lambda: seen[1], 10, "the member to learn quorum 41 from its leader")
        leader.quorum_answered(Quorum(40, members, 3, 2), "store:8")
        leader.quorum_answered(Quorum(42, members[1:], 4, 2), "store:9")
        wait_for(lambda: len(seen[1]) == 2, 10, "the member to learn quorum 42 from its leader")
        assert Client(url).status()["quorum_id"] == -1  # the lighthouse decided none
        assert seen[0] == seen[1] == [(41, 1, 2, "store:9"), (42, 0, 1, "store:9")]
    finally:
        member.leave()
        leader.leave()


def loaded_by_importing(package: str) -> list[str]:
    """The modules of torch and of ours that importing every module of ``package`` loads, in a fresh interpreter."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"import {package} as package\n"
        "for module in pkgutil.iter_modules(package.__path__):\n"
        f"    importlib.import_module(f'{package}.{{module.name}}')\n"
        "print(' '.join(sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'lightning_fthsdp'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_importing_the_lighthouse_imports_no_torch() -> None:
    """Every lighthouse module imports without torch (only a starting lighthouse loads it, for its TCPStore) and
    without any package of ours but config and the wire types (protocol): nothing of the ranks' side (membership)."""
    loaded = loaded_by_importing("lightning_fthsdp.lighthouse")
    assert "lightning_fthsdp.lighthouse.server" in loaded and "lightning_fthsdp.lighthouse.readiness" in loaded
    allowed = {"lightning_fthsdp", "lightning_fthsdp.config", "lightning_fthsdp.protocol",
               "lightning_fthsdp.lighthouse"}
    unexpected = [name for name in loaded if ".".join(name.split(".")[:2]) not in allowed]
    assert not unexpected, unexpected


def test_the_ranks_side_imports_nothing_of_the_lighthouse_service() -> None:
    """The two sides of the control plane share only the wire types: every module of ``membership`` imports without
    any module of ``lighthouse``."""
    loaded = loaded_by_importing("lightning_fthsdp.membership")
    assert {"lightning_fthsdp.membership.client", "lightning_fthsdp.protocol.quorum"} <= set(loaded), loaded
    assert not [name for name in loaded if name.startswith("lightning_fthsdp.lighthouse")], loaded


def test_a_group_behind_that_has_not_asked_yet_holds_up_no_quorum(lighthouse: Callable[..., str]) -> None:
    """b restarts (it heartbeats at step 0 while it builds) as a, alone in the job, asks for its next step: a is
    answered at once. b holds nothing a lacks, so it counts neither as a group to wait for nor against a's majority;
    it joins the next round and catches up."""
    url = lighthouse(min_replicas=1, join_timeout_ms=30_000)
    first = form(url, "a")[0]
    second = form(url, "a", step=1, quorum_id=first["quorum_id"], committed_in=first["quorum_id"], members=("a",))[0]
    b = Client(url)  # its heartbeat connection stays open: b is alive
    assert b.call("POST", "/v1/heartbeat", hb("b", step=0))[0] == 200
    started = time.monotonic()
    code, third = Client(url).call("POST", "/v1/quorum", qr("a", 2, quorum_id=second["quorum_id"], members=("a",),
                                                            committed_in=second["quorum_id"], timeout_ms=20_000))
    assert code == 200 and [m["replica_id"] for m in third["members"]] == ["a"], third
    assert time.monotonic() - started < 5, "a waited for b, a group behind that had not asked"
    asking = Client(url)
    asking.send("POST", "/v1/quorum", qr("b", 0, timeout_ms=20_000))
    code, fourth = Client(url).call("POST", "/v1/quorum", qr("a", 3, quorum_id=third["quorum_id"], members=("a",),
                                                             committed_in=third["quorum_id"], timeout_ms=20_000))
    code_b, with_b = asking.recv()
    assert code == code_b == 200 and with_b["quorum_id"] == fourth["quorum_id"], (fourth, with_b)
    assert with_b["max_step"] == 3 and with_b["catch_up_from"] == {"b": "a"}, with_b


@pytest.mark.parametrize("via", ["heartbeat", "lost"])
@pytest.mark.parametrize(("lost_hung", "cause", "how"), [
    ([1], "hang", "it sent the leader nothing for the heartbeat timeout"),
    ([], "crash", "its connection to the leader closed"),
])
def test_a_lost_rank_reported_by_either_path_first_names_its_cause(
        lighthouse: Callable[..., str], lost_hung: list[int], cause: str, how: str, via: str) -> None:
    """The leader's heartbeat may reach the lighthouse before its ``POST /v1/lost`` or after it: the group is declared
    dead with the same cause and words either way (a 500 of /v1/lost once left the loss to the next heartbeat)."""
    url = lighthouse()
    leader = Client(url)
    assert leader.call("POST", "/v1/heartbeat", hb("a"))[0] == 200
    if via == "heartbeat":
        code, _ = leader.call("POST", "/v1/heartbeat", hb("a") | {"losses": 1, "lost": [1], "lost_hung": lost_hung})
    else:
        code, _ = leader.call("POST", "/v1/lost", {"replica_id": "a", "incarnation": inc("a"), "lost_rank": 1,
                                                   "cause": cause, "losses": 1})
    assert code == 200
    code, events = leader.call("GET", "/events")
    assert code == 200
    [death] = [e for e in events["events"] if e["kind"] == "death"]
    assert (death["replica_id"], death["cause"]) == ("a", cause), death
    assert f"its leader lost rank 1: {how}" in death["text"], death


def test_a_heartbeat_naming_a_hung_rank_it_did_not_lose_is_refused(lighthouse: Callable[..., str]) -> None:
    url = lighthouse()
    beat = hb("a") | {"losses": 1, "lost": [1], "lost_hung": [2]}
    code, body = Client(url).call("POST", "/v1/heartbeat", beat | {"shard_count": 3})
    assert code == 400 and "field 'lost_hung' must list ranks of 'lost'" in body["error"], body
