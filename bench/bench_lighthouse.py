"""Quorum latency of the lighthouse with many simulated replica groups over loopback.

One lighthouse subprocess (the real ``fthsdp lighthouse`` command) and one asyncio client process holding one
keep-alive connection per group. Each group heartbeats once (so the lighthouse knows every group is alive),
then every group asks for a quorum; the clock runs from the moment the last request was written to the moment
the last answer was fully read. Round 1 is a fresh quorum (decided when the last alive group asks), round 2
the steady state (every previous member asks again: the fast path). Every answer is checked: all members get
the same quorum of all N groups.

Usage: ``python bench/bench_lighthouse.py [--groups 1000 10000]``; writes ``bench/results/lighthouse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import os
import platform
import re
import resource
import secrets
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "lighthouse.json"
CONNECT_BATCH = 256  # stay well under the listen backlog
TOKEN = secrets.token_urlsafe(32)
"""The job's token, as every real deployment has one: each request pays for its check."""


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise SystemExit(f"bench needs {needed} open files, the hard limit is {hard}: lower --groups")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_lighthouse(groups: int) -> tuple[subprocess.Popen[str], str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", "--min-replicas", "1",
         "--join-timeout-ms", "60000", "--heartbeat-timeout-ms", "60000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        preexec_fn=lambda: raise_fd_limit(groups + 256), env={**os.environ, "FTHSDP_TOKEN": TOKEN},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.match(r"fthsdp lighthouse listening on http://([\d.]+):(\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"lighthouse did not start: {line!r}")
    return proc, match.group(1), int(match.group(2))


def post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\nAccept-Encoding: gzip\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


async def read_response(reader: asyncio.StreamReader, keep: bool = True) -> tuple[int, bytes, int]:
    """(status, body, crc32 of body); a gzip body stays compressed. With ``keep=False`` a 200 body is dropped:
    answers are compared by checksum and one is parsed (holding 10,000 would measure the client's allocator)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
    body = await reader.readexactly(length)
    return status, body if keep or status != 200 else b"", zlib.crc32(body)


async def quorum_round(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]], round_no: int) -> dict:
    n = len(conns)
    requests = [post("/v1/quorum", {"replica_id": f"g{i:05d}", "incarnation": "bench", "step": round_no,
                                    "shard_count": 8, "address": "",
                                    "commit_failed": False, "quorum_id": round_no - 1 if round_no else -1,
                                    "members": [], "committed_in": round_no - 1 if round_no else -1,
                                    "following": False,
                                    "timeout_ms": 60_000}) for i in range(n)]
    readers = [asyncio.ensure_future(read_response(r, keep=i == 0)) for i, (r, _) in enumerate(conns)]
    # The client process stands in for 10,000 processes: keep its own GC pauses out of the lighthouse's numbers.
    gc.collect()
    gc.disable()
    for (_, writer), request in zip(conns, requests, strict=True):
        writer.write(request)
    last_sent = time.perf_counter()
    answers = await asyncio.wait_for(asyncio.gather(*readers), 120)
    latency = time.perf_counter() - last_sent
    gc.enable()
    assert all(code == 200 for code, _, _ in answers), {(code, body) for code, body, _ in answers}
    assert all(crc == answers[0][2] for _, _, crc in answers), "members got different quorums"
    first = answers[0][1]
    quorum = json.loads(gzip.decompress(first) if first[:2] == b"\x1f\x8b" else first)
    assert len(quorum["members"]) == n and quorum["max_step"] == round_no, quorum["quorum_id"]
    return {"quorum_id": quorum["quorum_id"], "latency_s": latency, "answer_bytes": len(first)}


async def bench(groups: int) -> dict:
    proc, host, port = start_lighthouse(groups)
    try:
        conns = []
        for start in range(0, groups, CONNECT_BATCH):
            conns += await asyncio.gather(*(asyncio.open_connection(host, port, limit=1 << 24)
                                            for _ in range(start, min(groups, start + CONNECT_BATCH))))
        for i, (_, writer) in enumerate(conns):
            writer.write(post("/v1/heartbeat", {"replica_id": f"g{i:05d}", "incarnation": "bench", "step": 0,
                                                "shard_count": 8, "known_epoch": -1, "wait_ms": 0}))
        assert all(s == 200 for s, _, _ in await asyncio.gather(*(read_response(r) for r, _ in conns)))
        fresh = await quorum_round(conns, 0)
        steady = await quorum_round(conns, 1)
        for _, writer in conns:
            writer.close()
        return {"groups": groups, "fresh": fresh, "steady": steady}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1000, 10_000])
    args = parser.parse_args()
    raise_fd_limit(max(args.groups) + 256)
    rows = [asyncio.run(bench(n)) for n in args.groups]
    print(f"{'groups':>7} {'round':>7} {'quorum_id':>9} {'answer KiB':>10} {'latency ms':>10}")
    for row in rows:
        for kind in ("fresh", "steady"):
            r = row[kind]
            print(f"{row['groups']:>7} {kind:>7} {r['quorum_id']:>9} {r['answer_bytes'] / 1024:>10.1f} "
                  f"{r['latency_s'] * 1000:>10.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
