"""What keeps strangers out of a job: the token only in the Authorization header (Bearer, or Basic for a browser),
the rendezvous store bound where the lighthouse binds, slow and idle connections closed, and a CLI that refuses
unsafe or impossible settings at once, in one line, and never shows the token."""

from __future__ import annotations

import base64
import contextlib
import errno
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.rendezvous import rendezvous_prefix
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.membership.client import Heartbeat, QuorumClient
from tests.lighthouse_thread import LighthouseThread
from tests.unit.test_lighthouse import LISTENING, Client, hb, inc, leave

TOKEN = "tok-3xample"


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., LighthouseThread]]:
    """Start lighthouse threads (port 0, one replica suffices for a quorum); all are stopped after the test."""
    with contextlib.ExitStack() as stack:
        def start(**kw: Any) -> LighthouseThread:
            thread = LighthouseThread(**{"rules": QuorumRules(min_replicas=1), "heartbeat_timeout_ms": 30_000,
                                         "startup_grace_ms": 0, **kw})
            stack.enter_context(thread)
            return thread
        yield start


def get(url: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def basic(password: str, user: str = "me") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# --- the token, only in the Authorization header -----------------------------------------------------------------


def test_a_browser_is_asked_for_the_token_and_sees_the_page_with_it(lighthouse: Callable[..., Any]) -> None:
    url = lighthouse(token=TOKEN).lighthouse.url
    code, headers, body = get(url, "/", {})
    assert code == 401 and headers["www-authenticate"].startswith('Basic realm="fthsdp lighthouse"'), headers
    code, headers, page = get(url, "/", basic(TOKEN))
    assert code == 200 and headers["content-type"].startswith("text/html") and b"<h1>fthsdp lighthouse</h1>" in page
    assert TOKEN.encode() not in page
    assert get(url, "/status", basic(TOKEN, user=""))[0] == 200  # the user name is ignored
    for wrong in (basic("nope"), {"Authorization": "Basic !!not-base64"}, {"Authorization": f"Token {TOKEN}"}):
        code, headers, body = get(url, "/", wrong)
        assert code == 401 and "www-authenticate" in headers, wrong
    code, _, body = get(url, "/status", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200 and TOKEN.encode() not in body


def test_a_token_in_the_url_is_refused_even_with_the_right_header(lighthouse: Callable[..., Any]) -> None:
    url = lighthouse(token=TOKEN).lighthouse.url
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, basic(TOKEN)):
        code, _, body = get(url, f"/status?token={TOKEN}", headers)
        error = json.loads(body)["error"]
        assert code == 401 and "Authorization" in error and "?token=" in error and TOKEN not in error, error


# --- the store binds where the lighthouse binds -------------------------------------------------------------------


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the one its default route leaves from), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP connect sends nothing: it only picks the source address
            address = probe.getsockname()[0]
        except OSError:
            address = socket.gethostbyname(socket.gethostname())
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_the_store_and_http_listen_only_on_the_lighthouse_host(lighthouse: Callable[..., Any]) -> None:
    address = non_loopback_address()
    if address is None:
        print("skipped: this machine has no non-loopback IPv4 address to probe from")
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    thread = lighthouse(host="127.0.0.1", token=TOKEN)
    store_port = int(thread.lighthouse.store_address.rpartition(":")[2])
    for port in (store_port, thread.lighthouse.port):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5)


def test_rendezvous_prefixes_are_unguessable_without_the_token() -> None:
    assert rendezvous_prefix(None, 3) == "fthsdp/q3"
    with_token = {rendezvous_prefix(TOKEN.encode(), q) for q in range(100)}
    assert len(with_token) == 100 and not any(f"/q{q}" in p for q in range(100) for p in with_token)
    assert rendezvous_prefix(TOKEN.encode(), 3) != rendezvous_prefix(b"another job's token", 3)
    assert TOKEN not in "".join(with_token)


# --- slow and idle connections ------------------------------------------------------------------------------------


def test_a_slowloris_connection_is_answered_408_and_closed(lighthouse: Callable[..., Any]) -> None:
    url = lighthouse(request_timeout_s=0.5).lighthouse.url
    parts = urlsplit(url)
    request = b"GET /status HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
    with socket.create_connection((parts.hostname, parts.port), timeout=0.05) as sock:
        start, answer = time.monotonic(), b""
        for byte in request:  # one byte every 50 ms (the recv's timeout): never a whole head
            try:
                chunk: bytes | None = sock.recv(4096)
            except TimeoutError:
                chunk = None
            except ConnectionResetError:
                break
            if chunk == b"":
                break
            answer += chunk or b""
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.send(bytes([byte]))
            assert time.monotonic() - start < 5, "the lighthouse kept a trickling connection open for 5 s"
        else:
            pytest.fail("the whole trickled request was sent without the connection being closed")
    elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408") and b"first byte" in answer, answer[:200]
    assert 0.45 < elapsed < 2.5, elapsed


def test_fifty_idle_connections_are_closed_after_the_idle_bound(lighthouse: Callable[..., Any]) -> None:
    url = lighthouse(idle_timeout_s=0.5).lighthouse.url
    parts = urlsplit(url)
    start = time.monotonic()
    socks = [socket.create_connection((parts.hostname, parts.port), timeout=10) for _ in range(50)]
    try:
        for sock in socks[:25]:  # half of them served a request first: idle keep-alive connections
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        open_ = set(socks)
        deadline = time.monotonic() + 10
        while open_ and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_), [], [], 0.1)
            for sock in readable:
                while chunk := sock.recv(65536):  # an answer, then the close
                    assert chunk.startswith(b"HTTP/1.1 200"), chunk[:100]
                open_.discard(sock)
        assert not open_, f"{len(open_)} of 50 idle connections still open after 10 s"
        assert time.monotonic() - start > 0.45
    finally:
        for sock in socks:
            sock.close()
    assert Client(url).status()["groups"] == []  # and it serves on


def test_held_long_polls_are_not_idle_and_heartbeats_keep_a_group_alive(lighthouse: Callable[..., Any]) -> None:
    """Idle and request bounds far below the heartbeat interval: a held long-poll is never timed out, and the
    heartbeat client's connection never sits idle, so nobody is declared dead."""
    thread = lighthouse(idle_timeout_s=0.3, request_timeout_s=0.3, heartbeat_timeout_ms=3_000, token=TOKEN)
    url = thread.lighthouse.url
    poll = Client(url, token=TOKEN)
    epoch = poll.call("POST", "/v1/heartbeat", hb("x"))[1]["epoch"]
    start = time.monotonic()
    code, _ = poll.call("POST", "/v1/heartbeat", hb("x", epoch=epoch, wait_ms=1_000))
    assert code == 200 and time.monotonic() - start > 0.9  # held 1 s on a connection with a 0.3 s idle bound
    assert poll.call("POST", "/v1/leave", leave("x"))[0] == 200  # before its connection idles
    timeouts = Timeouts(heartbeat_interval_ms=500, heartbeat_timeout_ms=3_000, collective_timeout_ms=10_000,
                        quorum_timeout_ms=20_000, connect_timeout_ms=30_000, join_timeout_ms=1_000)
    deaths: list[frozenset[str]] = []
    beat = Heartbeat(url, TOKEN, "a", inc("a"), 0, 1, timeouts, step=lambda: 0, on_dead=deaths.append,
                     on_lost=lambda _: None, on_quorum=lambda *_: None)
    try:
        beat.start()
        # A fresh connection per look: the test's own idle connections are closed like anyone's.
        wait_for(lambda: any(g["replica_id"] == "a" for g in Client(url, token=TOKEN).status()["groups"]), 10,
                 "a's first heartbeat")
        time.sleep(2.5)  # the property under test is the absence of a death over several idle bounds
        group = next(g for g in Client(url, token=TOKEN).status()["groups"] if g["replica_id"] == "a")
        assert group["alive"] and not group["dead"] and beat.deaths == 0 and not deaths, (group, deaths)
    finally:
        beat.leave()


def test_the_client_resends_once_on_a_connection_the_lighthouse_closed_as_idle(
        lighthouse: Callable[..., Any]) -> None:
    url = lighthouse(idle_timeout_s=0.3, token=TOKEN).lighthouse.url
    timeouts = Timeouts(heartbeat_interval_ms=100, heartbeat_timeout_ms=1_000, collective_timeout_ms=5_000,
                        quorum_timeout_ms=10_000, connect_timeout_ms=20_000, join_timeout_ms=1_000)
    client = QuorumClient(url, TOKEN, timeouts, inc("solo"))
    try:
        quorum, _ = client.request("solo", 0, 1, "", False, None, -1, False)
        sock = client._conn._sock  # type: ignore[union-attr]  # the kept-alive socket, to see its close
        wait_for(lambda: select.select([sock], [], [], 0)[0] and not sock.recv(1, socket.MSG_PEEK), 10,
                 "the lighthouse to close the idle quorum connection")
        again, _ = client.request("solo", 1, 1, "", False, quorum, 0, False)
        assert again.member_ids == ("solo",)
    finally:
        client.close()


# --- the command line ---------------------------------------------------------------------------------------------


def lighthouse_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if k != "FTHSDP_TOKEN"}
    return subprocess.Popen([sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**base, **(env or {})},
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise AssertionError(f"the lighthouse did not exit within {timeout_s} s") from None
    return proc.returncode, out, err


def test_cli_refuses_unsafe_or_impossible_settings_at_once_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    hidden = tmp_path / "without_uvloop"  # a machine without the [uvloop] extra
    hidden.mkdir()
    (hidden / "uvloop.py").write_text("raise ImportError('No module named uvloop')\n")
    no_uvloop = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))}
    cases = [  # (arguments, environment, exit code, words the one line must hold)
        (["--token", TOKEN], {}, 2, ["--token", "FTHSDP_TOKEN", "--token-file"]),
        (["--host", "0.0.0.0"], {}, 2, ["0.0.0.0", "FTHSDP_TOKEN", "--insecure"]),
        (["--token-file", str(empty)], {}, 2, ["empty"]),
        (["--token-file", str(tmp_path / "missing")], {}, 2, ["missing"]),
        (["--host", "no-such-host.invalid"], {"FTHSDP_TOKEN": TOKEN}, 1, ["no-such-host.invalid"]),
        (["--host", "203.0.113.7"], {"FTHSDP_TOKEN": TOKEN}, 1, ["203.0.113.7"]),
        (["--host", "203.0.113.7", "--insecure"], {}, 1, ["203.0.113.7"]),
        (["--event-loop", "uvloop"], no_uvloop, 2, ["--event-loop uvloop", "lightning-fthsdp[uvloop]", "asyncio"]),
    ]
    procs = [(lighthouse_cli(*args, env=env), args, code, words) for args, env, code, words in cases]
    for proc, args, code, words in procs:
        got, out, err = finish(proc, 60)  # importing torch on 2 busy cores; a hang would be minutes
        lines = err.strip().splitlines()
        assert (got, out, len(lines)) == (code, "", 1), (args, got, out, err)
        assert all(word in lines[0] for word in words) and TOKEN not in lines[0], (args, lines[0])


def test_cli_reads_the_token_file_never_prints_it_and_ends_on_sigterm(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = lighthouse_cli("--token-file", str(token_file), env={"FTHSDP_TOKEN": "not-this-one"})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the lighthouse printed no listening line within 60 s"
        match = LISTENING.match(proc.stdout.readline().strip())
        assert match, "no listening line"
        url = match.group(1)
        assert Client(url, token="not-this-one").call("GET", "/status")[0] == 401
        assert Client(url, token=TOKEN).call("POST", "/v1/heartbeat", hb("a"))[0] == 200
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc, 10)
        assert code == 0 and time.monotonic() - start < 5
        assert TOKEN not in out + err and "lighthouse on" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_cli_ends_on_sigterm_even_while_starting(tmp_path: Path) -> None:
    """Before it listens, SIGTERM keeps its default action: the process ends wherever startup is. The token file is a
    FIFO, so startup is held reading it until the test has sent the signal."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    proc = lighthouse_cli("--token-file", str(fifo))
    try:
        deadline = time.monotonic() + 60
        while True:  # opening a FIFO's write end without blocking fails until a reader holds it
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as err:
                if err.errno != errno.ENXIO or time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"the lighthouse never opened its token file: {proc.poll()}") from err
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        code, out, _ = finish(proc, 10)
        os.close(writer)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert code == -signal.SIGTERM and "listening on" not in out, (code, out)
