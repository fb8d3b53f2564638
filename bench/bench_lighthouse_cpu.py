"""The lighthouse's own CPU per quorum request and per answer, and what the same round costs over sockets alone.

``bench_lighthouse.py`` times rounds end to end: 12,500 leaders in generator processes, real sockets, heartbeats beside
the rounds, all on the same cores. This bench takes them apart, in the same run:

1. **The lighthouse's Python**, in this process without sockets: every group's connection is a real
   ``http.Connection`` of a real ``Lighthouse`` (its token checked, its routes, claims, liveness, rounds and answers)
   over an in-memory transport; the request bytes are the ones ``membership.connection`` writes, built before the
   clock starts. Each steady round (every group asks, holding the quorum of the round before, one step further) is
   timed in two parts, with ``time.process_time``: **request**, handing every group's request to its connection until
   each is held (HTTP framing, token, body parse, the claims, the group's liveness and its held request); **answer**,
   the decision and the writing of every answer. Each group's heartbeat is held all along, as a live leader's is; one
   whose long-poll ends (5 s) is held again between rounds, untimed, but the answers it got count in the round they
   came in: such a round is shown (``heartbeats_answered``) and left out of the medians. The heartbeat timeout is an
   hour: no group dies.
2. **The baseline**: the last steady round's request bytes again, through ``http.Connection`` objects (the same class)
   to a handler that only parses each body as JSON, holds it, and answers every one with one shared response once all
   have asked: what the lighthouse costs beyond its HTTP layer and a JSON parse. Both run with the lighthouse
   command's garbage-collector settings.
3. **The sockets**: the same round over loopback TCP, ``--clients`` processes holding the groups' connections (each
   writes every group's quorum request, then reads every answer) and a server process on asyncio's event loop that
   only counts the requests and, once every group has asked, writes each one the size of a steady answer: the time
   from the last request written to the last answer read (as ``bench_lighthouse.py`` times a steady round), and from
   the first request written. A lighthouse on that event loop, doing nothing else, needs at least this.

The steady-round target of issue 30 (0.3 s at 12,500 groups) leaves 24 microseconds per group for everything: the
lighthouse's Python, the sockets and the heartbeats beside the round.
Prints a table, writes bench/results/lighthouse_cpu.json::

    .venv/bin/python bench/bench_lighthouse_cpu.py

``--smoke``: 300 groups, 2 steady rounds of each kind (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import gzip
import json
import multiprocessing as mp
import platform
import random
import re
import resource
import selectors
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.messages import Pending, Request, Response, json_response
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.server import Lighthouse
from lightning_fthsdp.membership.connection import common_head, request_bytes
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.protocol.requests import heartbeat_body, quorum_body

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' in-memory transport, as bench_accelerate takes the tests' CPU FSDP fixture
from tests.memory_transport import MemoryTransport  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "lighthouse_cpu.json"
TOKEN = "bench-lighthouse-cpu-token-0123456789"
INCARNATION = "bench"
GROUP_SIZE = 8
TARGET_S, TARGET_GROUPS = 0.3, 12_500
"""Issue 30's steady round: 0.3 s at 100,000 ranks in groups of 8."""
_ANSWER = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r]*\r\n(?:[^\r]+\r\n)*?Content-Length: (\d+)\r\n(?:[^\r]+\r\n)*\r\n")


def answers_of(written: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of every answer in ``written``, bodies gunzipped."""
    found, at = [], 0
    while at < len(written):
        match = _ANSWER.match(written, at)
        if match is None:
            raise SystemExit(f"bench_lighthouse_cpu: an answer it cannot read: {written[at:at + 200]!r}")
        start = match.end()
        body = written[start:start + int(match.group(2))]
        found.append((int(match.group(1)), gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body))
        at = start + len(body)
    return found


def state_addresses(group: int) -> str:
    """A group's ``address`` as a real leader sends it: a state server per rank, a host per group."""
    rng = random.Random(group)
    host = f"10.{group >> 16 & 255}.{group >> 8 & 255}.{group & 255}"
    return ",".join(f"http://{host}:{rng.randrange(32768, 61000)}" for _ in range(GROUP_SIZE))


HEAD = common_head("127.0.0.1", 1, TOKEN)
"""The head every group's requests share (its Host is read by nothing here)."""


def quorum_request(group: int, step: int, held: Quorum | None, request_id: int) -> bytes:
    """Group ``group``'s quorum request at ``step``, holding ``held``, as ``membership.connection`` writes it."""
    return request_bytes("/v1/quorum", HEAD, json.dumps(quorum_body(
        f"g{group:06d}", INCARNATION, step, GROUP_SIZE, state_addresses(group), False, held,
        held.quorum_id if held else -1, False, 120_000)).encode(), request_id)


class Groups:
    """``count`` groups' connections to one handler, and the requests they send."""

    def __init__(self, count: int, connect: Callable[[], Connection]) -> None:
        self.ids = [f"g{i:06d}" for i in range(count)]
        self.transports = [MemoryTransport() for _ in self.ids]
        self.connections: list[Connection] = []
        for transport in self.transports:
            connection = connect()
            connection.connection_made(transport)
            self.connections.append(connection)
        self._request_id = 0

    def request(self, path: str, body: dict[str, object]) -> bytes:
        self._request_id += 1
        return request_bytes(path, HEAD, json.dumps(body).encode(), self._request_id)

    def quorum_requests(self, step: int, held: Quorum | None) -> list[bytes]:
        self._request_id += 1
        return [quorum_request(group, step, held, self._request_id) for group in range(len(self.ids))]

    def send(self, requests: list[bytes]) -> float:
        """Hand each group its request; the CPU seconds it took."""
        started = time.process_time()
        for connection, raw in zip(self.connections, requests, strict=True):
            connection.data_received(raw)
        return time.process_time() - started

    def send_some(self, requests: dict[int, bytes]) -> None:
        for index, raw in requests.items():
            self.connections[index].data_received(raw)

    def take_answers(self) -> list[list[tuple[int, bytes]]]:
        taken = [answers_of(bytes(t.written)) for t in self.transports]
        for transport in self.transports:
            transport.written.clear()
        return taken


async def settle(done: Callable[[], bool]) -> None:
    """Run the event loop until ``done()``: the lighthouse decides a round on a later turn than its last request."""
    deadline = time.monotonic() + 60
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit("the round was not answered within a minute")
        await asyncio.sleep(0)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench_lighthouse_cpu: {what}")


async def lighthouse_rounds(count: int, rounds: int) -> tuple[list[dict[str, float]], list[bytes]]:
    """A fresh round, then ``rounds`` steady ones, through a real Lighthouse: the steady rounds' CPU split, and the
    last one's requests."""
    lighthouse = Lighthouse(host="127.0.0.1", port=0, startup_grace_ms=0, token=TOKEN, heartbeat_timeout_ms=3_600_000,
                            rules=QuorumRules(min_replicas=1, join_timeout_ms=60_000))
    await lighthouse.start()
    try:
        groups = Groups(count, lighthouse._connect)
        groups.send([groups.request("/v1/heartbeat", heartbeat_body(rid, INCARNATION, 0, 0, GROUP_SIZE, -1, 0, lost={}))
                     for rid in groups.ids])
        await settle(lambda: all(t.written for t in groups.transports))
        epoch = json.loads(groups.take_answers()[0][0][1])["epoch"]
        beats = [groups.request("/v1/heartbeat", heartbeat_body(rid, INCARNATION, 0, 0, GROUP_SIZE, epoch, 5_000,
                                                                lost={})) for rid in groups.ids]
        groups.send(beats)
        held: Quorum | None = None
        measured, requests = [], []
        for step in range(rounds + 1):
            requests = groups.quorum_requests(step, held)
            request_s = groups.send(requests)
            started = time.process_time()
            # The decision writes every answer before it records its timing.
            await settle(lambda s=step: (last := lighthouse.last_round) is not None and last.step == s)
            answer_s = time.process_time() - started
            answers = groups.take_answers()
            quorum_answers = [[a for a in each if b'"max_step"' in a[1]] for each in answers]
            check(all(len(a) == 1 and a[0][0] == 200 for a in quorum_answers), f"a group's answers: {answers[0]}")
            check(len({a[0][1] for a in quorum_answers}) == 1, "groups got different answers")
            held = Quorum.from_json(json.loads(quorum_answers[0][0][1]), held)
            check(held.max_step == step and len(held.member_ids) == count,
                  f"round {step} answered step {held.max_step} with {len(held.member_ids)} of {count} groups")
            renewed = [i for i, each in enumerate(answers) if len(each) > 1]
            groups.send_some({i: beats[i] for i in renewed})
            if step:  # the first round is the fresh one: every group joins
                measured.append({"request_us": request_s / count * 1e6, "answer_us": answer_s / count * 1e6,
                                 "heartbeats_answered": len(renewed)})
        return measured, requests
    finally:
        await lighthouse.stop()


async def baseline_rounds(requests: list[bytes], rounds: int) -> list[dict[str, float]]:
    """``requests`` (one per group) through ``http.Connection`` to a handler that parses each body, holds it, and
    answers all with one response once every group has asked; once to warm up, then ``rounds`` times."""
    count, held = len(requests), []
    answer = json_response({"quorum_id": 0, "max_step": 0})

    def handler(request: Request) -> Response | Pending:
        request.json_object()
        held.append(request.defer())
        if len(held) == count:
            asyncio.get_running_loop().call_soon(answer_all)
        return held[-1]

    def answer_all() -> None:
        waiting = held[:]
        held.clear()
        for pending in waiting:
            pending.answer(answer)

    groups = Groups(count, lambda: Connection(handler, lambda connection: None))
    measured = []
    for step in range(rounds + 1):
        request_s = groups.send(requests)
        started = time.process_time()
        await settle(lambda: all(t.written for t in groups.transports))
        answer_s = time.process_time() - started
        check(all([status for status, _ in a] == [200] for a in groups.take_answers()),
              "a baseline group was not answered 200 once")
        if step:
            measured.append({"request_us": request_s / count * 1e6, "answer_us": answer_s / count * 1e6})
    return measured


SOCKET_ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 206\r\nX-Request-Id: 1\r\n\r\n"
                 + b" " * 206)
"""As long as a steady round's answer (a delta with nothing in it but the step)."""
PIPE_TIMEOUT_S = 120.0


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        try:  # a privileged user may raise the hard limit too
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, max(needed, hard)))
        except (ValueError, OSError):
            raise SystemExit(f"bench needs {needed} open files, the hard limit is {hard}: lower --groups") from None


def holding_server(pipe: Pipe, count: int, request_size: int) -> None:
    """Counts each connection's requests (``request_size`` bytes each); once ``count`` have come, answers them all."""
    raise_fd_limit(count + 256)

    async def serve() -> None:
        held: list[asyncio.Transport] = []

        class Holder(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport, self.received = transport, 0

            def data_received(self, data: bytes) -> None:
                self.received += len(data)
                while self.received >= request_size:
                    self.received -= request_size
                    held.append(self.transport)  # type: ignore[arg-type]
                if len(held) == count:
                    for transport in held:
                        transport.write(SOCKET_ANSWER)
                    held.clear()

        loop = asyncio.get_running_loop()
        server = await loop.create_server(Holder, "127.0.0.1", 0, backlog=4096)
        pipe.send(server.sockets[0].getsockname()[1])
        await loop.run_in_executor(None, pipe.recv)  # until told to stop, or the bench is gone
        server.close()

    asyncio.run(serve())


def socket_client(pipe: Pipe, port: int, count: int, request: bytes, rounds: int) -> None:
    """``count`` groups' connections: per round, write every request, then read every answer; reports (first
    written, last written, last read, bytes read)."""
    raise_fd_limit(count + 256)
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    pipe.send("connected")
    for _ in range(rounds):
        pipe.recv()
        first = time.monotonic()
        for sock in sockets:
            sock.send(request)  # a few hundred bytes into an empty send buffer: written whole
        last_written = time.monotonic()
        expected, read = count * len(SOCKET_ANSWER), 0
        while read < expected:
            events = selector.select(PIPE_TIMEOUT_S)
            if not events:
                raise SystemExit(f"socket client: {read} of {expected} answer bytes within {PIPE_TIMEOUT_S} s")
            for key, _ in events:
                data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                if not data:
                    raise SystemExit("socket client: the server closed a connection")
                read += len(data)
        pipe.send((first, last_written, time.monotonic(), read))
    pipe.recv()
    for sock in sockets:
        sock.close()


def receive(pipe: Pipe, processes: list[Any]) -> Any:
    """The next message on ``pipe``; SystemExit if it does not come while every one of ``processes`` lives."""
    deadline = time.monotonic() + PIPE_TIMEOUT_S
    while not pipe.poll(0.5):
        dead = [p.name for p in processes if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            raise SystemExit(f"socket rounds: {', '.join(dead)} ended early" if dead else
                             f"socket rounds: no message within {PIPE_TIMEOUT_S} s")
    try:
        return pipe.recv()
    except EOFError:  # its process ended (it said why on stderr)
        raise SystemExit("socket rounds: a server or client process ended early") from None


def socket_rounds(count: int, rounds: int, clients: int, request: bytes) -> list[dict[str, float]]:
    """``rounds`` rounds of ``count`` groups over loopback sockets to ``holding_server``, after one to warm up; each
    round's seconds, and the answers read (whole answers' worth of bytes)."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=holding_server, args=(theirs, count, len(request)), name="server", daemon=True)
    server.start()
    theirs.close()
    pipes, processes = [], [server]
    try:
        port = receive(ours, processes)
        for index in range(clients):
            pipe, end = context.Pipe()
            share = count // clients + (index < count % clients)
            processes.append(context.Process(target=socket_client, args=(end, port, share, request, rounds + 1),
                                             name=f"client {index}", daemon=True))
            processes[-1].start()
            end.close()
            pipes.append(pipe)
        for pipe in pipes:
            check(receive(pipe, processes) == "connected", "a socket client did not connect")
        measured = []
        for round_no in range(rounds + 1):
            for pipe in pipes:
                pipe.send("go")
            times = [receive(pipe, processes) for pipe in pipes]
            if round_no:
                measured.append({"last_request_to_last_answer_s": max(t[2] for t in times) - max(t[1] for t in times),
                                 "first_request_to_last_answer_s": max(t[2] for t in times) - min(t[0] for t in times),
                                 "answers_read": sum(t[3] for t in times) / len(SOCKET_ANSWER)})
        return measured
    finally:
        for pipe in (*pipes, ours):
            with contextlib.suppress(OSError):  # its process is gone already
                pipe.send("stop")
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def summary(measured: list[dict[str, float]]) -> dict[str, Any]:
    """The medians over the rounds no held heartbeat's answer fell in (each part apart), and every round."""
    clean = [m for m in measured if not m.get("heartbeats_answered")] or measured
    request_us = statistics.median(m["request_us"] for m in clean)
    answer_us = statistics.median(m["answer_us"] for m in clean)
    return {"rounds": [{name: round(value, 2) for name, value in m.items()} for m in measured],
            "rounds_in_median": len(clean), "request_us": round(request_us, 2), "answer_us": round(answer_us, 2),
            "group_us": round(request_us + answer_us, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=TARGET_GROUPS, help="replica groups asking in each round")
    parser.add_argument("--rounds", type=int, default=5, help="steady rounds of each kind (after one to start), median "
                                                              "reported")
    parser.add_argument("--clients", type=int, default=2, help="processes holding the groups' sockets in the socket "
                                                               "rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 300 groups, 2 rounds of each kind")
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.rounds = 300, 2
    if args.groups < 1 or args.rounds < 1 or not 1 <= args.clients <= args.groups:
        parser.error(f"--groups and --rounds must be at least 1 and --clients from 1 to --groups, got {args.groups}, "
                     f"{args.rounds} and {args.clients}")
    sockets = socket_rounds(args.groups, args.rounds, args.clients, quorum_request(0, 1, None, 1))
    check(all(m["answers_read"] == args.groups for m in sockets), f"answers read: {sockets}")
    socket_s = {name: round(statistics.median(m[name] for m in sockets), 4)
                for name in ("last_request_to_last_answer_s", "first_request_to_last_answer_s")}
    # As the lighthouse's own command does once started (lighthouse.cli): the setup's objects out of the collector,
    # the young generation collected less often.
    gc.freeze()
    gc.set_threshold(100_000, 20, 100)
    measured, requests = asyncio.run(lighthouse_rounds(args.groups, args.rounds))
    full = summary(measured)
    baseline = summary(asyncio.run(baseline_rounds(requests, args.rounds)))
    budget_us = TARGET_S / TARGET_GROUPS * 1e6
    print(f"one steady quorum round, CPU per group (median of {full['rounds_in_median']} and {args.rounds} rounds of "
          f"{args.groups} groups)")
    print(f"{'':48}{'request us':>11}{'answer us':>11}{'group us':>10}{'round s':>9}")
    for name, row in (("HTTP layer + JSON parse (baseline)", baseline), ("the lighthouse", full)):
        print(f"{name:48}{row['request_us']:>11.1f}{row['answer_us']:>11.1f}{row['group_us']:>10.1f}"
              f"{row['group_us'] * args.groups / 1e6:>9.3f}")
    ratio = full["group_us"] / baseline["group_us"]
    print(f"the lighthouse over the baseline: {ratio:.2f}x; the steady-round target leaves {budget_us:.0f} us per "
          f"group for everything ({TARGET_S} s at {TARGET_GROUPS:,} groups): this, the sockets, the heartbeats")
    print(f"the same round over loopback sockets to a server that only holds and answers ({args.clients} client "
          f"processes, median): last request to last answer {socket_s['last_request_to_last_answer_s']:.3f} s, "
          f"first request to last answer {socket_s['first_request_to_last_answer_s']:.3f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"python": platform.python_version(), "groups": args.groups, "rounds": args.rounds,
                                    "baseline": baseline, "lighthouse": full, "ratio": round(ratio, 3),
                                    "clients": args.clients, "socket_round": {**socket_s, "rounds": sockets},
                                    "target_budget_us": round(budget_us, 1)}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
