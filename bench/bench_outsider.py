"""Outsider-flood benchmark: a job's committed steps per second undisturbed, and while someone without the token
floods its lighthouse (issue 28, probes A and E).

    python bench/bench_outsider.py            # writes bench/results/outsider.json
    python bench/bench_outsider.py --smoke    # a short run (tests/integration/test_bench_smoke.py runs it)

Two replica groups (a, b) of lightning_fthsdp.demo.train_plain against a real lighthouse started under
``prlimit --nofile=N`` (``--open-files``: the descriptor limit the idle flood exhausts). One job; after a warm-up,
``--repeats`` times a span of ``--seconds`` of each scenario, in this order:

- **none**: undisturbed, the baseline;
- **pipeline** (probe A): ``--connections`` connections, each sending ``--requests`` pipelined ``GET /`` without the
  token and without reading an answer, a fresh round on each ``--rounds-per-s`` times a second;
- **idle** (probe E): ``--open-files`` + 200 idle connections opened at once and held (more than the lighthouse may
  open: before the cap on outsiders, it ran out of descriptors);
- **churn**: the same, and whichever the lighthouse closes is opened again, ``--reopen-per-s`` a second at most
  (a flood of connects rather than of held descriptors).

The job's rate: the step committed (the highest any group committed, from the groups' JSONL logs) at the span's end
minus at its start, over the span. Each flood's ratio (``over_none``) is its rates over the undisturbed spans' of the
same run, all repeats summed; the issue asks for >= 0.9. Also per span: the groups the lighthouse declared dead,
steps discarded, and the CPU the lighthouse and the flooding threads (this process) used, in cores. The attacker runs
on the job's own cores here: on a machine with few, its CPU is the job's loss whatever the lighthouse does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from lightning_fthsdp.launch.processes import Group, Job, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = ("a", "b")
PIPELINED = b"GET / HTTP/1.1\r\n\r\n"
IDLE_TICK_S = 0.05


class PipelineFlood:
    """Probe A: ``connections`` threads, each connecting and sending ``requests`` pipelined ``GET /`` without the token
    and without reading the answers, ``rounds_per_s`` rounds a second (the next round starts when the last one's send
    ended, refused or not). ``rounds`` counts the rounds sent. A context manager: leaving stops and joins them."""

    def __init__(self, host: str, port: int, connections: int = 4, requests: int = 65_536,
                 rounds_per_s: float = 1.0) -> None:
        self._address, self._payload, self._period = (host, port), PIPELINED * requests, 1 / rounds_per_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.rounds = 0
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"flood-{i}")
                         for i in range(connections)]

    def __enter__(self) -> PipelineFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                with socket.create_connection(self._address, timeout=5) as sock:
                    sock.sendall(self._payload)
            except OSError:
                pass  # refused, reset or closed by the lighthouse: the round was sent as far as it let it
            with self._lock:
                self.rounds += 1
            self._stop.wait(max(0.0, self._period - (time.monotonic() - start)))


class IdleFlood:
    """Probe E: ``count`` idle connections (they send nothing), held; with ``reopen_per_s``, one the lighthouse closes
    is opened again, that many a second at most. ``opened`` counts every connect that succeeded. A context manager:
    entering returns once ``count`` connects were tried; leaving closes them all."""

    def __init__(self, host: str, port: int, count: int, reopen_per_s: float = 0.0) -> None:
        self._address, self._count, self._reopen = (host, port), count, max(0, round(reopen_per_s * IDLE_TICK_S))
        self._socks: dict[int, socket.socket] = {}
        self._poll = select.poll()
        self._stop = threading.Event()
        self.opened = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="idle-flood")

    def __enter__(self) -> IdleFlood:
        for _ in range(self._count):
            self._open()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        for sock in self._socks.values():
            sock.close()

    def _open(self) -> None:
        try:
            sock = socket.create_connection(self._address, timeout=2)
        except OSError:
            return  # the lighthouse's backlog is full: a later tick tries again
        self._socks[sock.fileno()] = sock
        self._poll.register(sock, select.POLLIN)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.wait(IDLE_TICK_S):
            for fd, _ in self._poll.poll(0):  # an idle connection turns readable only when the lighthouse closed it
                self._poll.unregister(fd)
                self._socks.pop(fd).close()
            for _ in range(min(self._reopen, self._count - len(self._socks))):
                self._open()


def job_step_at(groups: dict[str, Group], t: float) -> int:
    """The job's committed step at wall time ``t``: the highest step any group had committed by then."""
    return max((r["step"] for g in groups.values() for r in g.records() if r["t"] <= t), default=0)


def discards(groups: dict[str, Group], start: float, end: float) -> int:
    return sum(1 for g in groups.values() for r in g.records("discard") if start <= r["t"] <= end)


def deaths(job: Job, start: float, end: float) -> int:
    request = urllib.request.Request(f"{job.lighthouse_url}/events", headers=job.auth_headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        events = json.loads(response.read())["events"]
    return sum(1 for e in events if e["kind"] == "death" and start <= e["t"] <= end)


def lighthouse_address(job: Job) -> tuple[str, int]:
    host, _, port = job.lighthouse_url.removeprefix("http://").rpartition(":")
    return host, int(port)


def start_job(workdir: Path, open_files: int, step_time_ms: int, warmup: int) -> tuple[Job, dict[str, Group]]:
    """A job of ``GROUPS`` whose lighthouse may open ``open_files`` descriptors, once it committed ``warmup`` steps."""
    job = Job(workdir, min_replicas=2, replica_ids=GROUPS, lighthouse_prefix=("prlimit", f"--nofile={open_files}"))
    job.start_lighthouse()
    groups = {rid: job.start_group(rid, 1_000_000, step_time_ms=step_time_ms) for rid in GROUPS}
    wait_for(lambda: job_step_at(groups, time.time()) >= warmup, 120, f"the job to commit {warmup} steps")
    return job, groups


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every span of the run (see the module docstring)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        job, groups = start_job(args.keep or Path(tmp), args.open_files, args.step_time_ms, args.warmup)
        try:
            host, port = lighthouse_address(job)
            assert job.lighthouse is not None
            lighthouse = psutil.Process(job.lighthouse.pid)
            floods = {"none": None,
                      "pipeline": lambda: PipelineFlood(host, port, args.connections, args.requests, args.rounds_per_s),
                      "idle": lambda: IdleFlood(host, port, args.open_files + 200),
                      "churn": lambda: IdleFlood(host, port, args.open_files + 200, args.reopen_per_s)}
            for _ in range(args.repeats):
                for scenario in args.scenarios:
                    make = floods[scenario]
                    with make() if make is not None else contextlib.nullcontext() as flood:
                        start, cpu, own = time.time(), sum(lighthouse.cpu_times()[:2]), time.process_time()
                        time.sleep(args.seconds)  # the span measured: the rate is read from the groups' logs later
                        end, cpu, own = (time.time(), sum(lighthouse.cpu_times()[:2]) - cpu,
                                         time.process_time() - own)
                    steps = job_step_at(groups, end) - job_step_at(groups, start)
                    rows.append({"scenario": scenario, "steps": steps, "seconds": round(end - start, 3),
                                 "steps_per_s": steps / (end - start), "deaths": deaths(job, start, end),
                                 "discards": discards(groups, start, end),
                                 "lighthouse_cpu": cpu / (end - start), "flood_cpu": own / (end - start),
                                 "flood": (f"{flood.rounds} rounds" if isinstance(flood, PipelineFlood) else
                                           f"{flood.opened} connects" if isinstance(flood, IdleFlood) else "")})
                    print(f"{scenario:>9}: {rows[-1]['steps_per_s']:.2f} steps/s ({steps} steps in "
                          f"{end - start:.1f} s, {rows[-1]['deaths']} deaths, lighthouse {cpu / (end - start):.2f} "
                          f"cores, flood {rows[-1]['flood'] or '-'})", flush=True)
        finally:
            job.close()
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: steps/s over all its spans, and that over the undisturbed spans'."""
    rate = {}
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        spans = [r for r in rows if r["scenario"] == scenario]
        rate[scenario] = sum(r["steps"] for r in spans) / sum(r["seconds"] for r in spans)
    base = rate.get("none")
    return [{"scenario": scenario, "steps_per_s": value, "over_none": value / base if base else None,
             "deaths": sum(r["deaths"] for r in rows if r["scenario"] == scenario),
             "discards": sum(r["discards"] for r in rows if r["scenario"] == scenario)}
            for scenario, value in rate.items()]


def _print(rows: list[dict[str, Any]]) -> None:
    cols = list(dict.fromkeys(c for row in rows for c in row))
    print(" ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print(" ".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v!s:>14}" for v in (row[c] for c in cols)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-time-ms", type=int, default=50, help="the groups' step time")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured span of each scenario")
    parser.add_argument("--warmup", type=int, default=5, help="steps the job commits before the first span")
    parser.add_argument("--open-files", type=int, default=1024, help="the lighthouse's descriptor limit (prlimit)")
    parser.add_argument("--connections", type=int, default=4, help="probe A's connections")
    parser.add_argument("--requests", type=int, default=65_536, help="pipelined requests per round of probe A")
    parser.add_argument("--rounds-per-s", type=float, default=1.0, help="rounds per second of each connection")
    parser.add_argument("--reopen-per-s", type=float, default=200.0, help="the churn flood's connects per second")
    parser.add_argument("--repeats", type=int, default=3, help="spans of each scenario, interleaved")
    parser.add_argument("--scenarios", nargs="+", default=["none", "pipeline", "idle", "churn"],
                        choices=("none", "pipeline", "idle", "churn"), help="in this order, each repeat")
    parser.add_argument("--keep", type=Path, default=None, help="keep the processes' logs under this folder")
    parser.add_argument("--out", type=Path, default=RESULTS / "outsider.json", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: one 3 s span of none, pipeline and "
                                                             "idle")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.warmup, args.repeats, args.scenarios = 3.0, 3, 1, ["none", "pipeline", "idle"]
    if "none" not in args.scenarios:
        parser.error(f"--scenarios {' '.join(args.scenarios)} lacks none, the baseline every ratio is over")
    rows = measure(args)
    summary = summarise(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "runs": rows, "summary": summary}, indent=2))
    print()
    _print(rows)
    print()
    _print(summary)
    print(f"over_none: the job's committed steps/s under each flood over the undisturbed spans'; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
