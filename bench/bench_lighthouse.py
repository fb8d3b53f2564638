"""The lighthouse at scale: simulated replica groups heartbeating at the default interval, then quorum rounds.

One lighthouse subprocess (the real ``fthsdp lighthouse`` command, default heartbeat timeout) and ``--generators`` load-
generator processes, each an asyncio loop standing in for a share of the groups. Every group speaks the real protocol as
its leader does (``lighthouse.client.Heartbeat`` and ``QuorumClient`` on one ``LighthouseConnection``): one keep-alive
connection carrying heartbeat long-polls (the group's other ranks beat to their leader, never here) and, in a quorum
round, the group's quorum request, pipelined behind the held heartbeat (which the lighthouse then answers at once), no
heartbeat while it is held, and after its answer the next long-poll (answered at once instead only when the lease could
run out before a held one came back, as the real leader's). One connection per group keeps the lighthouse within the
20,000 descriptors a process may hold on this machine at 12,500 groups. After a warm-up, a steady window measures
heartbeats/s, the lighthouse's CPU share, the heartbeat round trip (which includes the lighthouse's hold of one
interval) and the generators' CPU; then quorum rounds run under that load: round 1 a fresh quorum (decided when the last
group asks), the next ones the steady state (every member asks again), and a last one after a membership change (one
group leaves, as ``Heartbeat.leave`` does, so the quorum id changes). A round's time runs from the last request written
to the last answer read, and its CPU seconds, the lighthouse's and each generator's, are counted over it; a round's
answer bytes are one group's answer as sent (gzip- compressed when large). Groups declared dead are counted from
``/status`` at the end.

The quorum requests are the real client's (``lighthouse.client.quorum_request_body``): the quorum held is named by its
id and members digest, its members are sent only when the lighthouse answers 428 for them, and the answers, full or a
delta against the quorum held, are decoded with ``Quorum.from_json`` into the quorum each group holds next. Every group
of a generator holds the same quorum and the lighthouse sends every holder of one quorum the same bytes (each round
checks the answers' CRCs are all equal), so each generator decodes one answer a round and stands it for all of its
groups: decoding each (O(groups) per group) would make the generators, not the lighthouse, the bottleneck. The driver
checks every generator rebuilt the same membership, the one expected.

Usage: ``python bench/bench_lighthouse.py --ranks 100000 --group-size 8``; writes ``bench/results/lighthouse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import zlib
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.client import quorum_request_body, with_members
from lightning_fthsdp.lighthouse.quorum import Quorum

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


def start_lighthouse(fds: int, heartbeat_timeout_ms: int) -> tuple[subprocess.Popen[str], str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", "--min-replicas", "1",
         "--join-timeout-ms", "60000", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)],
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


def post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\nAccept-Encoding: gzip\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
    return status, await reader.readexactly(length)


def read_json(body: bytes) -> dict[str, object]:
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- one generator process ----

class Generator:
    """The groups ``first..first+count-1`` of ``total``: their heartbeat loops, and quorum rounds on demand."""

    def __init__(self, host: str, port: int, first: int, count: int, total: int, group_size: int,
                 interval_ms: int, lease_ms: int) -> None:
        self.host, self.port, self.total, self.group_size = host, port, total, group_size
        self.first = first
        self.ids = [f"g{i:06d}" for i in range(first, first + count)]
        self.interval_ms, self.lease_ms = interval_ms, lease_ms  # the lease: the lighthouse's heartbeat timeout
        self.window = (float("inf"), float("inf"))
        self.rtts: list[float] = []
        self.errors = 0
        self.stop = False
        self.left: set[int] = set()
        self.answered = asyncio.Event()  # every group's quorum request of the round under way was answered
        self.held: Quorum | None = None
        """The quorum every group of this generator holds (see the module docstring)."""
        # Per group, the requests written and not answered yet, in order (the lighthouse answers in order): (path,
        # when written, the quorum request's body).
        self.in_flight: list[deque[tuple[str, float, dict[str, object]]]] = [deque() for _ in range(count)]
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.answers: list[tuple[int, int, bytes]] = []
        self.last_sent = self.last_answer = 0.0

    def heartbeat(self, replica_id: str, epoch: int, wait_ms: int) -> bytes:
        return post("/v1/heartbeat", {"replica_id": replica_id, "incarnation": INCARNATION, "rank": 0, "step": 0,
                                      "shard_count": self.group_size, "known_epoch": epoch, "wait_ms": wait_ms,
                                      "losses": 0, "lost": []})

    async def connect(self) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        self.conns = []
        for start in range(0, len(self.ids), CONNECT_BATCH):
            batch = min(len(self.ids), start + CONNECT_BATCH) - start
            self.conns += await asyncio.gather(*(asyncio.open_connection(self.host, self.port, limit=1 << 24)
                                                 for _ in range(batch)))
        return self.conns

    async def beat(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   epoch: int) -> None:
        """One group's leader, as ``client.Heartbeat`` and ``QuorumClient`` share one connection: a heartbeat
        long-poll in flight whenever nothing else is, the quorum requests ``quorum_round`` pipelines behind it (which
        release it), no heartbeat while a quorum request is held, and after its answer the next heartbeat, answered
        at once only when the lease (the lighthouse's heartbeat timeout from the newest answered heartbeat's sending)
        has less than two intervals left."""
        replica_id = self.ids[index]
        in_flight = self.in_flight[index]
        renew = False
        acknowledged = time.monotonic()  # when the newest answered heartbeat was sent: the lease runs from then
        while not self.stop and index not in self.left:
            if not in_flight:
                writer.write(self.heartbeat(replica_id, epoch, 0 if renew else self.interval_ms))
                in_flight.append(("/v1/heartbeat", time.monotonic(), {}))
            status, body = await read_response(reader)
            done = time.monotonic()
            path, sent, asked = in_flight.popleft()
            if path == "/v1/quorum":
                renew = self.lease_ms / 1000 - (done - acknowledged) < 2 * self.interval_ms / 1000
                self.answer(index, writer, status, body, asked)
                continue
            renew = False
            if status != 200:
                self.errors += 1
                await asyncio.sleep(self.interval_ms / 1000)
                continue
            acknowledged = sent
            epoch = int(re.search(rb'"epoch": ?(\d+)', body).group(1))  # type: ignore[union-attr]
            if self.window[0] <= done <= self.window[1]:  # answered in the window: the rate is answers per second
                self.rtts.append(done - sent)

    def ask(self, index: int, body: dict[str, object]) -> None:
        """Write the group's quorum request behind its held heartbeat, as ``QuorumClient.request`` does."""
        self.conns[index][1].write(post("/v1/quorum", body))
        self.in_flight[index].append(("/v1/quorum", time.monotonic(), body))

    def answer(self, index: int, writer: asyncio.StreamWriter, status: int, answer: bytes,
               asked: dict[str, object]) -> None:
        """The group's quorum answer: sent again with the members of the quorum held when the lighthouse answers 428
        for them."""
        if status == 428 and self.held is not None and "members" not in asked:
            self.ask(index, with_members(asked, self.held))
            return
        self.last_answer = max(self.last_answer, time.monotonic())
        self.answers.append((status, zlib.crc32(answer), answer if not self.answers or status != 200 else b""))
        if len(self.answers) == len(self.ids) - len(self.left):
            self.answered.set()

    async def quorum_round(self, round_no: int) -> dict[str, object]:
        """Every group still in the job asks at once (a leader asks as its step's forward starts), holding the quorum
        of the last round and having committed step ``round_no`` in it."""
        self.answers, self.last_answer = [], 0.0
        cpu_start = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        self.answered.clear()
        held = self.held
        for index, replica_id in enumerate(self.ids):
            if index not in self.left:
                self.ask(index, quorum_request_body(replica_id, INCARNATION, round_no, self.group_size, "", False,
                                                    held, held.quorum_id if held else -1, False, QUORUM_TIMEOUT_MS))
        self.last_sent = time.monotonic()
        await asyncio.wait_for(self.answered.wait(), 300)
        bad = [(code, body[:200]) for code, _, body in self.answers if code != 200]
        assert not bad, bad[:3]
        assert len({crc for _, crc, _ in self.answers}) == 1, "members got different answers"
        answer = self.answers[0][2]
        self.held = Quorum.from_json(read_json(answer), self.held)
        return {"cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu_start,
                "last_sent": self.last_sent, "last_answer": self.last_answer, "answer": answer,
                "quorum_id": self.held.quorum_id, "max_step": self.held.max_step, "members": self.held.member_ids}

    async def leave(self, group: int, beat: asyncio.Future[None]) -> None:
        """Group number ``group`` (one of this generator's) leaves as ``Heartbeat.leave`` does: its heartbeats stop,
        the one in flight is answered, and ``POST /v1/leave`` follows on the same connection."""
        index = group - self.first
        self.left.add(index)
        await beat
        reader, writer = self.conns[index]
        writer.write(post("/v1/leave", {"replica_id": self.ids[index], "incarnation": INCARNATION, "rank": 0}))
        status, body = await read_response(reader)
        assert status == 200, body[:200]
        writer.close()


def generator_main(pipe: Connection, host: str, port: int, first: int, count: int, total: int, group_size: int,
                   interval_ms: int, lease_ms: int) -> None:
    raise_fd_limit(count + 256)
    asyncio.run(_generator(pipe, Generator(host, port, first, count, total, group_size, interval_ms, lease_ms)))


async def _generator(pipe: Connection, gen: Generator) -> None:
    loop = asyncio.get_running_loop()
    beats = await gen.connect()
    for rid, (_, writer) in zip(gen.ids, beats, strict=True):  # every group known before the window
        writer.write(gen.heartbeat(rid, -1, 0))
    first_answers = await asyncio.gather(*(read_response(r) for r, _ in beats))
    refused = [(code, body[:200]) for code, body in first_answers if code != 200]
    assert not refused, f"{len(refused)} first heartbeats refused, e.g. {refused[0]}"
    epochs = [int(json.loads(body)["epoch"]) for _, body in first_answers]
    tasks = [asyncio.ensure_future(gen.beat(index, r, w, epoch))
             for index, ((r, w), epoch) in enumerate(zip(beats, epochs, strict=True))]
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
            pipe.send(await gen.quorum_round(command[1]))
        elif command[0] == "leave":
            await gen.leave(command[1], tasks[command[1] - gen.first])
            pipe.send("left")
        else:
            gen.stop = True
            for task in tasks:
                task.cancel()
            return


# ---- the driver ----

def bench(ranks: int, group_size: int, generators: int, window_s: float, rounds: int,
          timeouts: Timeouts) -> dict[str, object]:
    if ranks % group_size:
        raise SystemExit(f"--ranks {ranks} is no multiple of --group-size {group_size}")
    groups = ranks // group_size
    proc, host, port = start_lighthouse(groups + 512, timeouts.heartbeat_timeout_ms)
    ctx = mp.get_context("spawn")
    pipes, workers = [], []
    try:
        share = -(-groups // generators)
        for g in range(generators):
            first, count = g * share, min(share, groups - g * share)
            ours, theirs = ctx.Pipe()
            worker = ctx.Process(target=generator_main, args=(theirs, host, port, first, count, groups, group_size,
                                                              timeouts.heartbeat_interval_ms,
                                                              timeouts.heartbeat_timeout_ms), daemon=True)
            worker.start()
            pipes.append(ours)
            workers.append(worker)
        for pipe in pipes:
            if not pipe.poll(600):
                raise SystemExit("a generator did not connect its groups within 600 s")
            assert pipe.recv() == "ready"
        time.sleep(3 * timeouts.heartbeat_interval_ms / 1000)  # warm-up: the long-polls spread out
        for pipe in pipes:
            pipe.send(("cpu",))
        gen_cpu_start = [pipe.recv() for pipe in pipes]
        start = time.monotonic()
        lighthouse_cpu_start = cpu_seconds_of(proc.pid)
        for pipe, cpu in zip(pipes, gen_cpu_start, strict=True):
            pipe.send(("window", start, start + window_s, cpu))
        reports = [pipe.recv() for pipe in pipes]
        elapsed = time.monotonic() - start
        lighthouse_cpu = (cpu_seconds_of(proc.pid) - lighthouse_cpu_start) / elapsed
        rtts = sorted(r for report in reports for r in report["rtts"])
        quorum_rounds: list[dict[str, object]] = []
        members = tuple(f"g{i:06d}" for i in range(groups))
        for round_no in range(rounds + 1):
            kind = "fresh" if round_no == 0 else "steady" if round_no < rounds else "change"
            if kind == "change":  # the first group leaves: every other leader gets the new membership as a delta
                pipes[0].send(("leave", 0))
                assert pipes[0].recv() == "left"
                members = members[1:]
            lighthouse_cpu_before = cpu_seconds_of(proc.pid)
            for pipe in pipes:
                pipe.send(("quorum", round_no))
            results = [pipe.recv() for pipe in pipes]
            round_cpu = cpu_seconds_of(proc.pid) - lighthouse_cpu_before
            for result in results:  # every generator rebuilt the membership expected, at the step expected
                assert result["members"] == members and result["max_step"] == round_no, (kind, result["quorum_id"])
            assert len({r["quorum_id"] for r in results}) == 1, [r["quorum_id"] for r in results]
            if quorum_rounds:
                same = results[0]["quorum_id"] == quorum_rounds[-1]["quorum_id"]
                assert same == (kind == "steady"), (kind, results[0]["quorum_id"], quorum_rounds[-1]["quorum_id"])
            quorum_rounds.append({"kind": kind, "quorum_id": results[0]["quorum_id"],
                                  "answer_bytes": len(results[0]["answer"]),
                                  "lighthouse_cpu_s": round(round_cpu, 3),
                                  "generator_cpu_s": [round(r["cpu_s"], 3) for r in results],
                                  "latency_s": max(r["last_answer"] for r in results) -
                                  max(r["last_sent"] for r in results)})
        request = urllib.request.Request(f"http://{host}:{port}/status", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            status = json.loads(response.read())
        dead = sum(1 for g in status["groups"] if g["dead"])
        return {
            "ranks": ranks, "group_size": group_size, "groups": groups, "generators": generators,
            "heartbeat_interval_ms": timeouts.heartbeat_interval_ms,
            "heartbeat_timeout_ms": timeouts.heartbeat_timeout_ms, "window_s": round(elapsed, 3),
            "heartbeats_per_s": round(len(rtts) / elapsed, 1),
            "ideal_heartbeats_per_s": round(groups * 1000 / timeouts.heartbeat_interval_ms, 1),
            "lighthouse_cpu": round(lighthouse_cpu, 3),
            "generator_cpu": [round(r["cpu_s"] / elapsed, 3) for r in reports],
            "heartbeat_errors": sum(r["errors"] for r in reports),
            "rtt_p50_ms": round(statistics.median(rtts) * 1000, 1) if rtts else None,
            "rtt_p99_ms": round(rtts[int(len(rtts) * 0.99)] * 1000, 1) if rtts else None,
            "groups_dead": dead, "quorum_rounds": quorum_rounds,
            "load_average": os.getloadavg(),
        }
    finally:
        for pipe in pipes:
            pipe.send(("stop",))
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[100_000])
    parser.add_argument("--group-size", type=int, default=8, help="ranks per replica group")
    parser.add_argument("--generators", type=int, default=2, help="load-generator processes")
    parser.add_argument("--window-s", type=float, default=20.0, help="length of the steady window")
    parser.add_argument("--rounds", type=int, default=3,
                        help="quorum rounds (the first fresh, then steady), then one more after a group leaves")
    defaults = Timeouts()
    parser.add_argument("--heartbeat-interval-ms", type=int, default=defaults.heartbeat_interval_ms)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=defaults.heartbeat_timeout_ms,
                        help="the lighthouse's (a group silent this long is declared dead)")
    args = parser.parse_args()
    timeouts = Timeouts(heartbeat_interval_ms=args.heartbeat_interval_ms,
                        heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    rows = [bench(n, args.group_size, args.generators, args.window_s, args.rounds, timeouts) for n in args.ranks]
    print(f"{'ranks':>7} {'groups':>6} {'hb/s (ideal)':>15} {'lighthouse CPU':>14} {'RTT p50/p99 ms':>15} "
          f"{'dead':>4} {'quorum fresh/steady/change s':>28} {'generators CPU':>16}")
    for row in rows:
        rounds = row["quorum_rounds"]
        steady = [r["latency_s"] for r in rounds if r["kind"] == "steady"]
        print(f"{row['ranks']:>7} {row['groups']:>6} {row['heartbeats_per_s']:>7.0f} "
              f"({row['ideal_heartbeats_per_s']:>5.0f})"
              f" {row['lighthouse_cpu'] * 100:>13.0f}% {row['rtt_p50_ms']:>7} / {row['rtt_p99_ms']:<6}"
              f" {row['groups_dead']:>4} {rounds[0]['latency_s']:>10.2f} / "
              f"{(max(steady) if steady else float('nan')):<6.2f} / {rounds[-1]['latency_s']:<6.2f}"
              f" {'+'.join(f'{c * 100:.0f}%' for c in row['generator_cpu']):>16}")
    print(f"\n{'ranks':>7} {'round':>5} {'kind':>6} {'quorum_id':>9} {'latency_s':>9} {'answer_bytes':>12} "
          f"{'lighthouse CPU s':>16} {'generators CPU s':>16}")
    for row in rows:
        for number, rnd in enumerate(row["quorum_rounds"]):
            print(f"{row['ranks']:>7} {number:>5} {rnd['kind']:>6} {rnd['quorum_id']:>9} {rnd['latency_s']:>9.3f} "
                  f"{rnd['answer_bytes']:>12} {rnd['lighthouse_cpu_s']:>16.2f} "
                  f"{'+'.join(f'{c:.2f}' for c in rnd['generator_cpu_s']):>16}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
