"""The lighthouse at scale: simulated replica groups heartbeating at the default interval, then quorum rounds.

One lighthouse subprocess (the real ``fthsdp lighthouse`` command, default heartbeat timeout) and ``--generators`` load-
generator processes, each an asyncio loop standing in for a share of the groups. Every group speaks the real protocol as
its leader does (``membership.client.Heartbeat`` and ``QuorumClient`` on one ``LighthouseConnection``): one keep-alive
connection carrying heartbeat long-polls (the group's other ranks beat to their leader, never here) and, in a quorum
round, the group's quorum request beside its held heartbeat, each with a request id, the quorum answer coming as soon as
the quorum is decided (a new quorum wakes no held heartbeat: the leader relays its answer to its ranks); the request
names every rank's state address as a real leader's does (``state_addresses``). One connection
per group keeps the lighthouse within the 20,000 descriptors a process may hold on this machine at 12,500 groups. After
a warm-up, a steady window measures heartbeats/s, the lighthouse's CPU share, the heartbeat round trip (which includes
the lighthouse's hold of one interval) and the generators' CPU; then quorum rounds run under that load: round 1 a fresh
quorum (decided when the last group asks), then ``--rounds`` in the steady state (every member asks again), then
``--rounds`` failure rounds: in each, one group's connection is dropped without a goodbye (a crash) and another group
stops heartbeating with its connection open (a hang); the lighthouse wakes every held heartbeat with each death, and
every other group asks for the next quorum as the news of both reaches it, with its commit failed, as ``FTManager``
does. A steady round's time runs from the last request written to the last answer read; a failure round's from the
first heartbeat answer naming both dead (the moment the lighthouse knew) to the last answer read. The lighthouse's
own timing of each round's decision (``/status`` ``last_round``) is printed beside it: ``gather`` from the oldest
request's arrival to the decision (here, with every group asking at once, the lighthouse reading every request),
``answer`` the decision and the writing of its answers. A round's CPU
seconds, the lighthouse's and each generator's, are counted over it; its answer bytes are one group's answer as sent
(gzip-compressed when large). ``rounds`` gives each kind's min / median / max. Deaths declared over the run among the
groups that never failed (a false death revived since counts) and those of them dead at the end are read from
``/status``.

The quorum requests are the real client's (``protocol.requests.quorum_body``): the quorum held is named by its
id and members digest, its members are sent only when the lighthouse answers 428 for them, and the answers, full or a
delta against the quorum held, are decoded with ``Quorum.from_json`` into the quorum each group holds next. Every group
of a generator holds the same quorum and the lighthouse sends every holder of one quorum the same bytes (each round
checks the answers' CRCs are all equal), so each generator decodes one answer a round and stands it for all of its
groups: decoding each (O(groups) per group) would make the generators, not the lighthouse, the bottleneck. The driver
checks every generator rebuilt the same membership, the one expected.

Usage: ``python bench/bench_lighthouse.py --ranks 100000 --group-size 8``; writes ``bench/results/lighthouse.json``.
``--smoke``: 300 groups (more than one address may hold before they ask), one generator, a 1 s window, 0.5 s / 2 s
heartbeats, two rounds of each kind after the fresh one (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import re
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.membership.connection import common_head, request_bytes
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.protocol.requests import heartbeat_body, quorum_body, with_members

RESULTS = Path(__file__).resolve().parent / "results" / "lighthouse.json"
CONNECT_BATCH = 256  # stay well under the listen backlog
TOKEN = os.environ.setdefault("FTHSDP_BENCH_TOKEN", secrets.token_urlsafe(32))
"""The job's token, as every real deployment has one: each request pays for its check (the generators, spawned,
inherit it through the environment)."""


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            try:  # a privileged user may raise the hard limit too
                resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))
            except (ValueError, OSError):
                raise SystemExit(f"bench needs {needed} open files, the hard limit is {hard}: lower --ranks") from None
            return
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_lighthouse(fds: int, heartbeat_timeout_ms: int,
                     event_loop: str) -> tuple[subprocess.Popen[str], str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", "--min-replicas", "1",
         "--join-timeout-ms", "60000", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms),
         "--event-loop", event_loop],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        preexec_fn=lambda: raise_fd_limit(fds), env={**os.environ, "FTHSDP_TOKEN": TOKEN},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.match(r"fthsdp lighthouse listening on http://([\d.]+):(\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"lighthouse did not start: {line!r}")
    return proc, match.group(1), int(match.group(2))


QUORUM_TIMEOUT_MS = 120_000
INCARNATION = "bench"


def read_json(body: bytes) -> dict[str, object]:
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- one generator process ----

def state_addresses(group: int, group_size: int) -> str:
    """What a real leader sends as its group's ``address``: every rank's state server, a host per group and a port the
    OS picked (one of the ephemeral range, pseudo-random per rank so the bytes are like a real job's)."""
    rng = random.Random(group)
    host = f"10.{group >> 16 & 255}.{group >> 8 & 255}.{group & 255}"
    return ",".join(f"http://{host}:{rng.randrange(32768, 61000)}" for _ in range(group_size))


_CONTENT_LENGTH = re.compile(rb"Content-Length: (\d+)")
_REQUEST_ID = re.compile(rb"X-Request-Id: (\d+)")
_EPOCH = re.compile(rb'"epoch": ?(\d+)')
_DEAD = re.compile(rb'"dead": ?\[[^\]]*\]')


def dead_list(answer: bytes) -> bytes:
    """The ``dead`` list of a heartbeat answer, as sent (its ``deaths`` counts name groups revived since too)."""
    found = _DEAD.search(answer)
    return found.group() if found else b""


class Leader(asyncio.Protocol):
    """One simulated group leader's connection: it parses the lighthouse's answers as they arrive and hands each to
    its generator with the request it answers (by its ``X-Request-Id``, as ``client.LighthouseConnection`` matches
    them). A Protocol rather than a stream reader per group: the generators must cost less than the lighthouse they
    load, and a coroutine per group and answer costs several times the parse."""

    def __init__(self, gen: Generator, index: int) -> None:
        self.gen, self.index = gen, index
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        # The requests written and not answered yet, by id: (path, when written, the quorum request's body).
        self.in_flight: dict[int, tuple[str, float, dict[str, object]]] = {}
        self.ids = itertools.count(1)
        self.beating = False  # a heartbeat is in flight
        self.epoch = -1
        self.crashed = False  # its connection was dropped without a goodbye, as a killed process's is
        self.hung = False  # it sends nothing more, its connection open, as a stopped process
        self.asked_in = -1  # the failure round it asked in (it asks as the news of the failure reaches it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send the group's first heartbeat (answered at once) with the connection, as a leader's client writes its
        request as soon as it is connected: the lighthouse counts a connection that has sent no request as an
        outsider's, and a burst of them from one address is what a flood looks like."""
        self.transport = transport  # type: ignore[assignment]
        self.gen.heartbeat(self, 0)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end])
            length = int(_CONTENT_LENGTH.search(head).group(1))  # type: ignore[union-attr]
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            request_id = int(_REQUEST_ID.search(head).group(1))  # type: ignore[union-attr]
            self.gen.answered(self, self.in_flight.pop(request_id), int(head[9:12]), body)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.gen.stop and not self.crashed:
            self.gen.errors += 1
            if not self.gen.ready.is_set():  # no heartbeat of it would ever be answered: fail now, not at a timeout
                self.gen.lost_early = f"the lighthouse closed group {self.index}'s connection before it was started"
                self.gen.ready.set()

    def send(self, path: str, body: dict[str, object]) -> None:
        assert self.transport is not None
        request_id = next(self.ids)
        # As LighthouseConnection.post writes it: the lighthouse parses the same head and body.
        self.transport.write(request_bytes(path, self.gen.head, json.dumps(body).encode(), request_id))
        self.in_flight[request_id] = (path, time.monotonic(), body)


class Generator:
    """The groups ``first..first+count-1`` of ``total``: their heartbeat long-polls, and quorum rounds on demand."""

    def __init__(self, host: str, port: int, first: int, count: int, total: int, group_size: int,
                 interval_ms: int) -> None:
        self.host, self.port, self.total, self.group_size = host, port, total, group_size
        self.head = common_head(host, port, TOKEN)
        self.first = first
        self.ids = [f"g{i:06d}" for i in range(first, first + count)]
        self.addresses = [state_addresses(i, group_size) for i in range(first, first + count)]
        self.interval_ms = interval_ms
        self.window = (float("inf"), float("inf"))
        self.rtts: list[float] = []
        self.errors = 0
        self.stop = False
        self.started = 0  # leaders whose first heartbeat was answered
        self.ready = asyncio.Event()  # every leader's first heartbeat was answered (or ``lost_early`` says why not)
        self.lost_early = ""
        self.answered_all = asyncio.Event()  # every group's quorum request of the round under way was answered
        self.held: Quorum | None = None
        """The quorum every group of this generator holds (see the module docstring)."""
        self.leaders: list[Leader] = []
        self.answers: list[tuple[int, int, bytes]] = []
        self.asking = 0  # the groups asking in the round under way
        self.last_sent = self.last_answer = 0.0
        self.failure: tuple[int, tuple[bytes, ...]] | None = None
        """In a failure round: its number and the failed groups' quoted ids, which a heartbeat answer names (in its
        dead list) once the lighthouse knows of them."""

    @property
    def staying(self) -> list[Leader]:
        return [leader for leader in self.leaders if not leader.crashed and not leader.hung]

    def heartbeat(self, leader: Leader, wait_ms: int) -> None:
        leader.beating = True
        leader.send("/v1/heartbeat", heartbeat_body(self.ids[leader.index], INCARNATION, 0, 0, self.group_size,
                                                    leader.epoch, wait_ms, lost={}))

    async def connect(self) -> None:
        """Connect every group (a batch at a time; each sends its first heartbeat as it connects) and wait until each
        first heartbeat is answered."""
        loop = asyncio.get_running_loop()
        for start in range(0, len(self.ids), CONNECT_BATCH):
            batch = range(start, min(len(self.ids), start + CONNECT_BATCH))
            connected = await asyncio.gather(*(loop.create_connection(lambda i=i: Leader(self, i), self.host,
                                                                      self.port) for i in batch))
            self.leaders += [leader for _, leader in connected]
        await self.ready.wait()

    def answered(self, leader: Leader, request: tuple[str, float, dict[str, object]], status: int,
                 body: bytes) -> None:
        """The answer to ``request`` of ``leader``: as ``client.Heartbeat`` and ``QuorumClient`` do on one connection,
        a heartbeat long-poll is in flight all along, and the quorum requests ``quorum_round`` sends are answered
        beside it."""
        done = time.monotonic()
        path, sent, asked = request
        if path == "/v1/quorum":
            self.answer(leader, status, body, asked)
            return
        leader.beating = False
        if status != 200:
            self.errors += 1
            asyncio.get_running_loop().call_later(self.interval_ms / 1000, self.beat, leader)
            return
        else:
            first = leader.epoch < 0
            leader.epoch = int(_EPOCH.search(body).group(1))  # type: ignore[union-attr]
            if first:
                self.started += 1
                if self.started == len(self.ids):
                    self.ready.set()
            elif self.window[0] <= done <= self.window[1]:  # answered in the window: the rate is answers per second
                self.rtts.append(done - sent)
            if self.failure is not None and leader.asked_in < self.failure[0] and not leader.hung and all(
                    failed in dead_list(body) for failed in self.failure[1]):
                # As FTManager does when the news of a death ends its step's exchange: it asks again at once, its
                # commit failed.
                leader.asked_in = self.failure[0]
                self.last_sent = min(self.last_sent, done)
                self.ask(leader, self.request(leader, self.failure[0], True))
        self.beat(leader)

    def beat(self, leader: Leader) -> None:
        """The next heartbeat long-poll, unless one is in flight or the group failed. From the first answer on, as a
        real leader's: one that waited for every other group to connect would be silent past the timeout at 12,500
        groups, and rightly declared dead."""
        if self.stop or leader.beating or leader.crashed or leader.hung:
            return
        self.heartbeat(leader, self.interval_ms)

    def ask(self, leader: Leader, body: dict[str, object]) -> None:
        """Write the group's quorum request beside its held heartbeat, as ``QuorumClient.request`` does."""
        leader.send("/v1/quorum", body)

    def answer(self, leader: Leader, status: int, answer: bytes, asked: dict[str, object]) -> None:
        """The group's quorum answer: sent again with the members of the quorum held when the lighthouse answers 428
        for them."""
        if status == 428 and self.held is not None and "members" not in asked:
            self.ask(leader, with_members(asked, self.held))
            return
        self.last_answer = max(self.last_answer, time.monotonic())
        self.answers.append((status, zlib.crc32(answer), answer if not self.answers or status != 200 else b""))
        if len(self.answers) == self.asking:
            self.answered_all.set()

    def request(self, leader: Leader, round_no: int, commit_failed: bool) -> dict[str, object]:
        """The group's quorum request, holding the quorum of the last round and having committed step ``round_no``
        in it."""
        held = self.held
        return quorum_body(self.ids[leader.index], INCARNATION, round_no, self.group_size, self.addresses[leader.index],
                           commit_failed, held, held.quorum_id if held else -1, False, QUORUM_TIMEOUT_MS)

    async def quorum_round(self, round_no: int, failed: tuple[str, ...] = ()) -> dict[str, object]:
        """Every group still in the job asks at once (a leader asks as its step's forward starts). With ``failed``
        (the first crashes, the others hang; this generator fails those of its own groups), each group still in the
        job asks as the news that all of them are dead reaches it, in a heartbeat answer, and the round's time runs
        from the first such answer: from the moment the lighthouse knew."""
        self.answers, self.last_answer = [], 0.0
        cpu_start = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        self.answered_all.clear()
        if failed:
            for leader in self.leaders:
                if self.ids[leader.index] == failed[0]:
                    leader.crashed = True
                    assert leader.transport is not None
                    leader.transport.abort()
                elif self.ids[leader.index] in failed:
                    leader.hung = True
            self.asking, self.last_sent = len(self.staying), float("inf")
            self.failure = round_no, tuple(f'"{replica_id}"'.encode() for replica_id in failed)
        else:
            staying = self.staying
            self.asking = len(staying)
            for leader in staying:
                self.ask(leader, self.request(leader, round_no, False))
            self.last_sent = time.monotonic()
        try:
            await asyncio.wait_for(self.answered_all.wait(), 300)
        finally:
            self.failure = None
        bad = [(code, body[:200]) for code, _, body in self.answers if code != 200]
        assert not bad, bad[:3]
        assert len({crc for _, crc, _ in self.answers}) == 1, "members got different answers"
        answer = self.answers[0][2]
        self.held = Quorum.from_json(read_json(answer), self.held)
        return {"cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu_start, "errors": self.errors,
                "last_sent": self.last_sent, "last_answer": self.last_answer, "answer": answer,
                "quorum_id": self.held.quorum_id, "max_step": self.held.max_step, "members": self.held.member_ids}


def generator_main(pipe: Connection, host: str, port: int, first: int, count: int, total: int, group_size: int,
                   interval_ms: int) -> None:
    raise_fd_limit(count + 256)
    asyncio.run(_generator(pipe, Generator(host, port, first, count, total, group_size, interval_ms)))


async def _generator(pipe: Connection, gen: Generator) -> None:
    loop = asyncio.get_running_loop()
    await gen.connect()  # every group known before the window
    if gen.lost_early:
        pipe.send(gen.lost_early)
        return
    for leader in gen.leaders:  # the long-polls of a job's groups, started at different times, spread over an interval
        loop.call_later(leader.index / len(gen.leaders) * gen.interval_ms / 1000, gen.beat, leader)
    pipe.send("ready")
    while True:
        command = await loop.run_in_executor(None, pipe.recv)
        if command[0] == "window":
            gen.window = (command[1], command[2])
            await asyncio.sleep(max(0.0, command[2] - time.monotonic()))
            usage_start = command[3]
            usage = resource.getrusage(resource.RUSAGE_SELF)
            pipe.send({"rtts": gen.rtts, "errors": gen.errors,
                       "cpu_s": usage.ru_utime + usage.ru_stime - usage_start})
        elif command[0] == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            pipe.send(usage.ru_utime + usage.ru_stime)
        elif command[0] == "quorum":
            pipe.send(await gen.quorum_round(*command[1:]))
        else:
            gen.stop = True
            for leader in gen.leaders:
                if leader.transport is not None:
                    leader.transport.close()
            return


# ---- the driver ----

class Fleet:
    """The real lighthouse (a subprocess) and ``generators`` processes standing in for the leaders of ``groups``
    groups, each group connected, its first heartbeat answered and its long-polls started."""

    def __init__(self, groups: int, group_size: int, generators: int, timeouts: Timeouts,
                 event_loop: str = "auto") -> None:
        self.groups, self.group_size, self.timeouts = groups, group_size, timeouts
        self.members = tuple(f"g{i:06d}" for i in range(groups))
        """The groups still in the job (``quorum_round`` fails the first ones when asked to)."""
        self.proc, self.host, self.port = start_lighthouse(groups + 512, timeouts.heartbeat_timeout_ms, event_loop)
        self.pipes: list[Connection] = []
        self.workers: list[mp.Process] = []
        try:
            self._start_generators(generators)
        except BaseException:
            self.close()
            raise

    def _start_generators(self, generators: int) -> None:
        ctx = mp.get_context("spawn")
        share = -(-self.groups // generators)
        for g in range(generators):
            first, count = g * share, min(share, self.groups - g * share)
            ours, theirs = ctx.Pipe()
            worker = ctx.Process(target=generator_main, args=(theirs, self.host, self.port, first, count, self.groups,
                                                              self.group_size, self.timeouts.heartbeat_interval_ms),
                                 daemon=True)
            worker.start()
            self.pipes.append(ours)
            self.workers.append(worker)
        for pipe in self.pipes:
            if not pipe.poll(600):
                raise SystemExit("a generator did not connect its groups within 600 s")
            if (said := pipe.recv()) != "ready":
                raise SystemExit(f"a generator failed: {said}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tell(self, *command: object) -> list[Any]:
        """Every generator's answer to ``command``."""
        for pipe in self.pipes:
            pipe.send(command)
        return [pipe.recv() for pipe in self.pipes]

    def quorum_round(self, round_no: int, fail: bool = False, timed: bool = True) -> dict[str, Any]:
        """Every group still in the job asks at once; checks each generator rebuilt the membership expected, at the
        step expected, in one quorum. ``fail``: first the first group still in the job crashes (its connection
        dropped without a goodbye) and the second hangs (silent, its connection open), and the others ask as the
        news of both deaths reaches them (see ``Generator.quorum_round``); ``known_after_s`` is the time from the
        failures to the first answer that brought it, the round's time runs from that answer. Also the lighthouse's
        own timing of the round's decision (``rounds.RoundTiming``), read from ``/status`` once the round is over
        (``timed``; the overload's rounds skip it: a /status between two of them would count in the recovery)."""
        failed = self.members[:2] if fail else ()
        self.members = self.members[len(failed):]
        lighthouse_cpu_before = cpu_seconds_of(self.proc.pid)
        failed_at = time.monotonic()
        results = self.tell("quorum", round_no, failed)
        round_cpu = cpu_seconds_of(self.proc.pid) - lighthouse_cpu_before
        for result in results:
            assert result["members"] == self.members and result["max_step"] == round_no, result["quorum_id"]
        assert len({r["quorum_id"] for r in results}) == 1, [r["quorum_id"] for r in results]
        # The lighthouse's own timing of the decision (rounds.RoundTiming): its time reading the requests and its time
        # answering them, apart.
        timing: dict[str, Any] = {}
        if timed:
            last = self.status()["last_round"]
            assert (last["quorum_id"], last["step"], last["requests"]) == (
                results[0]["quorum_id"], round_no, len(self.members)), last
            timing = {"lighthouse_gather_s": last["gather_s"], "lighthouse_answer_s": last["answer_s"]}
        return {"quorum_id": results[0]["quorum_id"], "answer_bytes": len(results[0]["answer"]), **timing,
                "lighthouse_cpu_s": round(round_cpu, 3), "heartbeat_errors": sum(r["errors"] for r in results),
                "generator_cpu_s": [round(r["cpu_s"], 3) for r in results],
                "latency_s": max(r["last_answer"] for r in results) - min(r["last_sent"] for r in results)
                if fail else max(r["last_answer"] for r in results) - max(r["last_sent"] for r in results),
                **({"known_after_s": round(min(r["last_sent"] for r in results) - failed_at, 3)} if fail else {})}

    def status(self, timeout_s: float = 60) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(("stop",))
        for worker in self.workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bench(ranks: int, group_size: int, generators: int, window_s: float, rounds: int,
          timeouts: Timeouts, event_loop: str) -> dict[str, Any]:
    if ranks % group_size:
        raise SystemExit(f"--ranks {ranks} is no multiple of --group-size {group_size}")
    with Fleet(ranks // group_size, group_size, generators, timeouts, event_loop) as fleet:
        time.sleep(3 * timeouts.heartbeat_interval_ms / 1000)  # warm-up: the long-polls spread out
        gen_cpu_start = fleet.tell("cpu")
        start = time.monotonic()
        lighthouse_cpu_start = cpu_seconds_of(fleet.proc.pid)
        for pipe, cpu in zip(fleet.pipes, gen_cpu_start, strict=True):
            pipe.send(("window", start, start + window_s, cpu))
        reports = [pipe.recv() for pipe in fleet.pipes]
        elapsed = time.monotonic() - start
        lighthouse_cpu = (cpu_seconds_of(fleet.proc.pid) - lighthouse_cpu_start) / elapsed
        rtts = sorted(r for report in reports for r in report["rtts"])
        quorum_rounds: list[dict[str, Any]] = []
        for round_no in range(2 * rounds + 1):
            kind = "fresh" if round_no == 0 else "steady" if round_no <= rounds else "failure"
            result = {"kind": kind, **fleet.quorum_round(round_no, fail=kind == "failure")}
            if quorum_rounds:
                same = result["quorum_id"] == quorum_rounds[-1]["quorum_id"]
                assert same == (kind == "steady"), (kind, result["quorum_id"], quorum_rounds[-1]["quorum_id"])
            quorum_rounds.append(result)
        staying = set(fleet.members)
        groups = [g for g in fleet.status()["groups"] if g["replica_id"] in staying]
        dead, deaths = sum(1 for g in groups if g["dead"]), sum(g["deaths"] for g in groups)
        return {
            "event_loop": event_loop, "ranks": ranks, "group_size": group_size, "groups": fleet.groups,
            "generators": generators,
            "heartbeat_interval_ms": timeouts.heartbeat_interval_ms,
            "heartbeat_timeout_ms": timeouts.heartbeat_timeout_ms, "window_s": round(elapsed, 3),
            "heartbeats_per_s": round(len(rtts) / elapsed, 1),
            "ideal_heartbeats_per_s": round(fleet.groups * 1000 / timeouts.heartbeat_interval_ms, 1),
            "lighthouse_cpu": round(lighthouse_cpu, 3),
            "generator_cpu": [round(r["cpu_s"] / elapsed, 3) for r in reports],
            # Over the whole run, the rounds' too: a heartbeat refused or a connection lost (but the crashed ones).
            "heartbeat_errors": quorum_rounds[-1]["heartbeat_errors"],
            "rtt_p50_ms": round(statistics.median(rtts) * 1000, 1) if rtts else None,
            "rtt_p99_ms": round(rtts[int(len(rtts) * 0.99)] * 1000, 1) if rtts else None,
            "groups_dead": dead, "deaths": deaths, "quorum_rounds": quorum_rounds,
            "rounds": {kind: spread([r["latency_s"] for r in quorum_rounds if r["kind"] == kind])
                       for kind in ("fresh", "steady", "failure")},
            "load_average": os.getloadavg(),
        }


def spread(values: list[float]) -> dict[str, float]:
    """Min, median and max of ``values``, in seconds."""
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


STATUS_TIMEOUT_S = 300.0
"""How long the overload run waits for ``/status`` (a starved lighthouse at tens of thousands of groups is slow)."""


def busy_loop() -> None:
    """A process that wants a whole core."""
    while True:
        pass


def renice(pid: int, nice: int) -> None:
    """Give process ``pid``'s first thread (a Python process's event loop) the nice value ``nice``, and its session
    too where the kernel groups sessions (autogroup: a nice value alone then weighs only within the session)."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))


def overload(fleet: Fleet, stall_s: float, starve_s: float, recover_within_s: float) -> dict[str, Any]:
    """Drive the lighthouse past its capacity twice, then let it recover: it is stopped (SIGSTOP) for ``stall_s``,
    then for ``starve_s`` it shares one core, at the lowest priority (nice 19), with a busy loop (the generators on
    the other cores). Nobody may be declared dead; ``/status`` is asked for during the stall (timed from the moment
    the lighthouse runs again: the groups' backlog is read at the same time) and under the starving (timed from the
    asking); then steady quorum rounds run until one takes no longer than the ``bound`` from the rounds before the
    load (three times the slowest, at least 0.5 s more than it), for at most ``recover_within_s``."""
    before = [fleet.quorum_round(n, timed=False)["latency_s"] for n in range(3)]  # a fresh round, two steady ones
    bound = max(3 * max(before[1:]), max(before[1:]) + 0.5)
    fleet.proc.send_signal(signal.SIGSTOP)
    answered: list[float] = []

    def ask() -> None:
        fleet.status(STATUS_TIMEOUT_S)
        answered.append(time.monotonic())

    asker = threading.Thread(target=ask, name="status-during-the-stall")
    asker.start()
    time.sleep(stall_s)
    resumed = time.monotonic()
    fleet.proc.send_signal(signal.SIGCONT)
    asker.join()
    assert answered, "/status asked during the stall got no answer"  # (the thread's error is printed)
    status_after_stall_s = answered[0] - resumed
    cpus = sorted(os.sched_getaffinity(0))
    others = set(cpus[1:]) or set(cpus)
    for worker in fleet.workers:
        os.sched_setaffinity(worker.pid, others)
    busy = mp.get_context("spawn").Process(target=busy_loop, daemon=True)
    busy.start()
    try:
        os.sched_setaffinity(busy.pid, {cpus[0]})
        os.sched_setaffinity(fleet.proc.pid, {cpus[0]})
        renice(fleet.proc.pid, 19)
        time.sleep(starve_s)
        asked_at = time.monotonic()
        status = fleet.status(STATUS_TIMEOUT_S)  # answerable while starved, however slowly
        status_s = time.monotonic() - asked_at
    finally:
        busy.kill()
        busy.join()
    load_ended = time.monotonic()
    with contextlib.suppress(PermissionError):  # lowering a nice value needs privilege: the core is its own again
        renice(fleet.proc.pid, 0)
    os.sched_setaffinity(fleet.proc.pid, set(cpus))
    for worker in fleet.workers:
        os.sched_setaffinity(worker.pid, set(cpus))
    after: list[float] = []
    while not after or (after[-1] > bound and time.monotonic() - load_ended < recover_within_s):
        after.append(fleet.quorum_round(len(after) + 3, timed=False)["latency_s"])
    groups = fleet.status()["groups"]
    return {"groups": fleet.groups, "heartbeat_interval_ms": fleet.timeouts.heartbeat_interval_ms,
            "heartbeat_timeout_ms": fleet.timeouts.heartbeat_timeout_ms, "stall_s": stall_s, "starve_s": starve_s,
            "rounds_before_s": [round(t, 3) for t in before], "bound_s": round(bound, 3),
            "rounds_after_s": [round(t, 3) for t in after], "recovered": after[-1] <= bound,
            "recovered_after_s": round(time.monotonic() - load_ended, 3),
            "status_after_stall_s": round(status_after_stall_s, 3), "status_under_load_s": round(status_s, 3),
            "lag_under_load": status["lighthouse_lag"],
            "deaths": sum(g["deaths"] for g in groups), "dead": sum(1 for g in groups if g["dead"])}


def print_overload(row: dict[str, Any]) -> None:
    print(f"{'groups':>6} {'hb ms':>11} {'stall s':>7} {'starve s':>8} {'deaths':>6} {'/status s (stall/starved)':>26} "
          f"{'rounds before s':>18} {'bound s':>7} {'rounds after s':>24} {'recovered in s':>14}")
    print(f"{row['groups']:>6} {row['heartbeat_interval_ms']:>5}/{row['heartbeat_timeout_ms']:<5} "
          f"{row['stall_s']:>7.1f} {row['starve_s']:>8.1f} {row['deaths']:>6} "
          f"{row['status_after_stall_s']:>19.2f}/{row['status_under_load_s']:<6.2f} "
          f"{' '.join(f'{t:.2f}' for t in row['rounds_before_s']):>18} {row['bound_s']:>7.2f} "
          f"{' '.join(f'{t:.2f}' for t in row['rounds_after_s'][-4:]):>24} {row['recovered_after_s']:>14.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[100_000])
    parser.add_argument("--group-size", type=int, default=8, help="ranks per replica group")
    parser.add_argument("--generators", type=int, default=2, help="load-generator processes")
    parser.add_argument("--window-s", type=float, default=20.0, help="length of the steady window")
    parser.add_argument("--rounds", type=int, default=5,
                        help="steady quorum rounds after the fresh one, and as many failure rounds (two groups fail "
                             "in each: one crashes, one hangs)")
    defaults = Timeouts()
    parser.add_argument("--heartbeat-interval-ms", type=int, default=defaults.heartbeat_interval_ms)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=defaults.heartbeat_timeout_ms,
                        help="the lighthouse's (a group silent this long is declared dead)")
    parser.add_argument("--event-loop", nargs="+", choices=("asyncio", "uvloop", "auto"), default=["asyncio", "uvloop"],
                        help="the lighthouse's event loop (fthsdp lighthouse --event-loop); with more than one, each "
                             "runs in turn and the rounds of each are compared with the first's (default: asyncio, "
                             "then uvloop)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run for CI: 300 groups (more than the lighthouse lets one address hold before "
                             "they ask), one generator, a 1 s window, a fresh round, two steady and two failure rounds")
    parser.add_argument("--overload", action="store_true",
                        help="instead: the lighthouse stopped for 2.5 heartbeat timeouts, then starved for 4 beside a "
                             "busy loop on one core, then quorum rounds until they are as fast as before (the first "
                             "--ranks only)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (steady and failure rounds each), got {args.rounds}")
    if args.smoke:
        args.ranks, args.generators, args.window_s, args.rounds = [2400], 1, 1.0, 2
        args.heartbeat_interval_ms, args.heartbeat_timeout_ms = 500, 2000  # a hang is found in seconds
    timeouts = Timeouts(heartbeat_interval_ms=args.heartbeat_interval_ms,
                        heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    if args.overload:
        timeout_s = timeouts.heartbeat_timeout_ms / 1000
        with Fleet(args.ranks[0] // args.group_size, args.group_size, args.generators, timeouts,
                   args.event_loop[0]) as fleet:
            row = overload(fleet, stall_s=2.5 * timeout_s, starve_s=4 * timeout_s, recover_within_s=60)
        print_overload(row)
        out = args.out.with_name("lighthouse_overload.json") if args.out == RESULTS else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(), **row}, indent=2)
                       + "\n")
        print(f"wrote {out}")
        return 0
    rows = [bench(n, args.group_size, args.generators, args.window_s, args.rounds, timeouts, loop)
            for n in args.ranks for loop in args.event_loop]
    print(f"{'loop':>7} {'ranks':>7} {'groups':>6} {'hb/s (ideal)':>15} {'lighthouse CPU':>14} {'RTT p50/p99 ms':>15} "
          f"{'dead':>4} {'deaths':>6} {'generators CPU':>16}")
    for row in rows:
        print(f"{row['event_loop']:>7} {row['ranks']:>7} {row['groups']:>6} {row['heartbeats_per_s']:>7.0f} "
              f"({row['ideal_heartbeats_per_s']:>5.0f})"
              f" {row['lighthouse_cpu'] * 100:>13.0f}% {row['rtt_p50_ms']:>7} / {row['rtt_p99_ms']:<6}"
              f" {row['groups_dead']:>4} {row['deaths']:>6}"
              f" {'+'.join(f'{c * 100:.0f}%' for c in row['generator_cpu']):>16}")
    print(f"\n{'loop':>7} {'ranks':>7} {'round':>7} {'rounds':>6} {'min s':>7} {'median s':>8} {'max s':>7} "
          f"{'median vs ' + args.event_loop[0]:>17}")
    for row in rows:
        baseline = next(r for r in rows if r["ranks"] == row["ranks"] and r["event_loop"] == args.event_loop[0])
        for kind, figures in row["rounds"].items():
            count = sum(1 for r in row["quorum_rounds"] if r["kind"] == kind)
            row.setdefault("median_vs_first_loop", {})[kind] = ratio = round(
                figures["median"] / baseline["rounds"][kind]["median"], 3)
            print(f"{row['event_loop']:>7} {row['ranks']:>7} {kind:>7} {count:>6} {figures['min']:>7.3f} "
                  f"{figures['median']:>8.3f} {figures['max']:>7.3f} {ratio:>17.2f}")
    print(f"\n{'loop':>7} {'ranks':>7} {'round':>5} {'kind':>7} {'quorum_id':>9} {'latency_s':>9} "
          f"{'known after s':>13} {'gather s':>8} {'answer s':>8} {'answer_bytes':>12} {'lighthouse CPU s':>16} "
          f"{'generators CPU s':>16}")
    for row in rows:
        for number, rnd in enumerate(row["quorum_rounds"]):
            known = f"{rnd['known_after_s']:.3f}" if "known_after_s" in rnd else "-"
            print(f"{row['event_loop']:>7} {row['ranks']:>7} {number:>5} {rnd['kind']:>7} {rnd['quorum_id']:>9} "
                  f"{rnd['latency_s']:>9.3f} "
                  f"{known:>13} {rnd['lighthouse_gather_s']:>8.3f} {rnd['lighthouse_answer_s']:>8.3f} "
                  f"{rnd['answer_bytes']:>12} {rnd['lighthouse_cpu_s']:>16.2f} "
                  f"{'+'.join(f'{c:.2f}' for c in rnd['generator_cpu_s']):>16}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
