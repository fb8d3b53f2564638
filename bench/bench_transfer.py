"""State-transfer bandwidth: ``fetch_state`` from a StateServer in another process, against raw loopback TCP.

For each size, a spawned server process builds a state tree of 16 float32 tensors, publishes it on a StateServer
and also serves the same bytes on a plain TCP socket. The parent then measures, between the same two processes:

- prepare: the server's ``prepare`` (splitting the snapshot and digesting every chunk; a source does it while its
  step computes, before it publishes);
- cold: the first fetch;
- then ``--repeat`` rounds, each a fetch (checked against the server's checksum) right before a raw copy of the same
  number of bytes into a preallocated buffer, fresh each time like the fetch's tensors: ``ratio`` is the median of
  the rounds' loopback / fetch time (pairs see the same load on a shared host; a best-of of each side would pair
  different moments), ``fetch_s`` and ``loopback_s`` the medians of each;
- warm: the best raw copy into one reused, already faulted buffer (``warm_ratio`` against the median fetch: the
  bare wire, an upper bound no receiver that allocates its result can reach).

The ratio fetch / loopback is what the protocol costs over the wire itself: HTTP framing, the manifest and, mostly,
the XXH3-64 digest of every byte (computed ahead, verified on arrival on ``VERIFY_WORKERS`` threads).

Usage: ``python bench/bench_transfer.py [--mib 64 512] [--repeat 5]``; writes ``bench/results/transfer.json``.
``--smoke``: 4 MiB, 2 rounds (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from lightning_fthsdp.recovery.client import VERIFY_WORKERS, fetch_state
from lightning_fthsdp.recovery.server import DIGEST_WORKERS, StateServer
from lightning_fthsdp.recovery.wire import byte_view

RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
TENSORS = 16
TOKEN = "bench-token"
STEP = 1
TIMEOUT_S = 120.0


def serve(mib: int, pipe: Connection) -> None:
    """Server process: publish the tree, serve the same bytes on a raw socket, exit when the parent says so."""
    numel = (mib << 20) // 4 // TENSORS
    tree = {"model": {f"layer{i}": torch.rand(numel) for i in range(TENSORS)}, "step": STEP}
    views = [byte_view(t) for t in tree["model"].values()]
    listener = socket.create_server(("127.0.0.1", 0))

    def loopback() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed: the bench is over
            with conn:
                for view in views:
                    conn.sendall(view)

    threading.Thread(target=loopback, daemon=True).start()
    checksum = sum(float(t.double().sum()) for t in tree["model"].values())
    server = StateServer(token=TOKEN)
    start = time.perf_counter()
    prepared = server.prepare(STEP, tree)
    prepare_s = time.perf_counter() - start
    server.publish(prepared)
    pipe.send((server.address, listener.getsockname()[1], checksum, prepare_s))
    if not pipe.poll(600):
        print("bench server: the parent never said stop; exiting")
    server.close()
    listener.close()


def fetch_once(address: str, checksum: float) -> float:
    start = time.perf_counter()
    tree = fetch_state(address, STEP, token=TOKEN, timeout_s=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    got = sum(float(t.double().sum()) for t in tree["model"].values())  # type: ignore[union-attr]
    if got != checksum:
        raise SystemExit(f"fetched state differs from the served one: checksum {got} != {checksum}")
    return elapsed


def loopback_once(port: int, nbytes: int, buffers: list[memoryview] | None = None) -> float:
    # By default fresh buffers, one per tensor, allocated (not timed) as fetch_state allocates its tensors: both get
    # memory the same way (the allocator may reuse freed pages for some sizes and map fresh ones for others) and pay
    # the same first-touch page faults while receiving. Reused, already faulted buffers give the wire's upper bound.
    if buffers is None:
        buffers = [byte_view(torch.empty(nbytes // TENSORS, dtype=torch.uint8)) for _ in range(TENSORS)]
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as conn:
        for buffer in buffers:
            got = 0
            while got < len(buffer):
                n = conn.recv_into(buffer[got:])
                if n == 0:
                    raise SystemExit(f"loopback copy ended {len(buffer) - got} bytes short of a tensor")
                got += n
    return time.perf_counter() - start


def measure(mib: int, repeat: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(mib, child_end), daemon=True)
    proc.start()
    try:
        if not parent_end.poll(TIMEOUT_S):
            raise SystemExit(f"bench server for {mib} MiB did not start within {TIMEOUT_S} s")
        address, port, checksum, prepare_s = parent_end.recv()
        nbytes = (mib << 20) // 4 // TENSORS * 4 * TENSORS
        cold = fetch_once(address, checksum)
        rounds = [(fetch_once(address, checksum), loopback_once(port, nbytes)) for _ in range(repeat)]
        fetch = statistics.median(f for f, _ in rounds)
        loop = statistics.median(lp for _, lp in rounds)
        ratio = statistics.median(lp / f for f, lp in rounds)
        warm_buffers = [byte_view(torch.empty(nbytes // TENSORS, dtype=torch.uint8)) for _ in range(TENSORS)]
        warm = min(loopback_once(port, nbytes, warm_buffers) for _ in range(repeat + 1))  # the first run faults it
        parent_end.send("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return {"mib": mib, "bytes": nbytes, "prepare_s": prepare_s, "cold_s": cold, "fetch_s": fetch,
            "fetch_GBps": nbytes / fetch / 1e9,
            "loopback_s": loop, "loopback_GBps": nbytes / loop / 1e9, "ratio": ratio,
            "warm_loopback_GBps": nbytes / warm / 1e9, "warm_ratio": warm / fetch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512], help="state sizes in MiB")
    parser.add_argument("--repeat", type=int, default=7, help="timed fetch + loopback rounds per size")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 4 MiB, 2 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.repeat = [4], 2
    rows = [measure(mib, args.repeat) for mib in args.mib]
    print(f"{'size':>8} {'prepare_s':>9} {'cold_s':>7} {'fetch_s':>7} {'fetch_GBps':>10} {'loopback_GBps':>13} "
          f"{'ratio':>5} {'warm_loopback_GBps':>18} {'warm_ratio':>10}")
    for row in rows:
        print(f"{row['mib']:>4} MiB {row['prepare_s']:>9.3f} {row['cold_s']:>7.3f} {row['fetch_s']:>7.3f} "
              f"{row['fetch_GBps']:>10.2f} {row['loopback_GBps']:>13.2f} {row['ratio']:>5.2f} "
              f"{row['warm_loopback_GBps']:>18.2f} {row['warm_ratio']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "tensors": TENSORS, "verify_workers": VERIFY_WORKERS, "digest_workers": DIGEST_WORKERS, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
