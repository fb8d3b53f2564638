"""FTAR benchmarks: steady per-step overhead, and the survivors' stall after SIGKILL / SIGSTOP of a group.

    python bench/bench_ftar.py                      # both parts, writes bench/results/ftar.json

Overhead: the same G processes and tensors run a plain torch.distributed allreduce (gloo, then divide) and
the fault-tolerant path (quorum + cross-group allreduce + commit vote), alternating blocks of steps, each step
padded with ``--compute-ms`` of emulated device compute (a sleep: on a GPU the compute does not use the CPU).
Ratio = median FT step time / median baseline step time, measured in the same run.

Stall: 3 replica groups of lightning_fthsdp.demo.train_plain against a real lighthouse; one group is killed (SIGKILL) or
stopped (SIGSTOP) from outside; stall = time from the signal to the survivors' next committed step.

``--smoke``: 2 blocks of 4 steps on 10,000 elements, one stall trial per signal (tests/integration/test_bench_smoke.py
runs it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import Job, wait_for
from lightning_fthsdp.manager import FTManager

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(rank: int, groups: int, store_port: int, lighthouse: str, token: str | None, args: argparse.Namespace,
            out: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    sizes = [args.numel // 4] * 4
    tensors = [torch.randn(n) for n in sizes]
    compute_s = args.compute_ms / 1000
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=groups)
    manager = FTManager(replica_id=f"g{rank}", lighthouse=lighthouse, timeouts=Timeouts(), token=token)
    times: dict[str, list[float]] = {"baseline": [], "baseline_flat": [], "fthsdp": []}

    def baseline_step() -> None:
        time.sleep(compute_s)
        for t in tensors:
            dist.all_reduce(t)
            t.div_(groups)

    def baseline_flat_step() -> None:
        # The plain path with the same bucketing FTAR does (one flat buffer), so the comparison is not flattered.
        time.sleep(compute_s)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat.div_(groups)
        for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(chunk.view_as(t))

    def ft_step() -> None:
        manager.begin_step()
        time.sleep(compute_s)
        manager.sync_gradients(tensors)
        assert manager.commit(), "a fault-free step must commit"

    for _ in range(args.warmup):
        baseline_step()
        ft_step()
    for _ in range(args.blocks):
        for mode, step in (("baseline", baseline_step), ("baseline_flat", baseline_flat_step), ("fthsdp", ft_step)):
            dist.barrier()
            for _ in range(args.steps):
                started = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - started)
    dist.barrier()
    manager.shutdown()
    dist.destroy_process_group()
    out.put((rank, times))


def overhead(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp), min_replicas=args.groups)
        try:
            lighthouse = job.start_lighthouse()
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            # Daemons: when one fails, the others (blocked on its collectives) end with this process.
            procs = [ctx.Process(target=_worker, args=(r, args.groups, store.port, lighthouse, job.token, args, out),
                                 daemon=True) for r in range(args.groups)]
            for p in procs:
                p.start()
            results = dict(_result(out, procs) for _ in procs)
            for p in procs:
                p.join(60)
        finally:
            job.close()
    base = statistics.median(results[0]["baseline"])
    flat = statistics.median(results[0]["baseline_flat"])
    ft = statistics.median(results[0]["fthsdp"])
    return {"groups": args.groups, "numel": args.numel, "compute_ms": args.compute_ms,
            "steps_per_mode": args.steps * args.blocks, "baseline_median_s": base, "baseline_flat_median_s": flat,
            "fthsdp_median_s": ft, "ratio": ft / base, "ratio_vs_flat": ft / flat, "target": 1.02}


def _result(out: mp.Queue, procs: list[mp.Process]) -> tuple[int, dict[str, list[float]]]:  # type: ignore[type-arg]
    """The next worker's times; SystemExit as soon as a worker ended without giving them (its error is above)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"a worker failed (exit codes {failed}): see its traceback above") from None
    raise SystemExit("the workers gave no times within 600 s")


def one_stall(args: argparse.Namespace, sig: signal.Signals, phase_s: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp), min_replicas=2, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
        try:
            job.start_lighthouse()
            a, b, c = (job.start_group(r, 100_000, step_time_ms=args.stall_step_ms) for r in "abc")
            wait_for(lambda: min(g.last_step() for g in (a, b, c)) >= 20, 120, "all groups to reach step 20")
            time.sleep(phase_s)  # vary the signal's phase within the step across trials
            signalled = time.time()
            os.killpg(c.proc.pid, sig)
            after = wait_for(lambda: [r["t"] for r in a.records() if r["t"] > signalled and r["participants"] == 2],
                             60, "a's next committed step without c")
            return after[0] - signalled
        finally:
            job.close()


def stall(args: argparse.Namespace, sig: signal.Signals) -> dict[str, object]:
    stalls = [one_stall(args, sig, 0.007 * trial) for trial in range(args.trials)]
    return {"signal": sig.name, "trials": args.trials, "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
            "stalls_s": stalls, "median_s": statistics.median(stalls),
            "target_s": 0.5 if sig == signal.SIGKILL else args.heartbeat_timeout_ms / 1000 + 0.5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1_000_000, help="gradient elements per group (float32)")
    parser.add_argument("--compute-ms", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30, help="steps per block and mode")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trials", type=int, default=5, help="stall trials per signal")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1_000)
    parser.add_argument("--stall-step-ms", type=int, default=50)
    parser.add_argument("--only", choices=("overhead", "stall"), default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "ftar.json", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run for CI: 2 blocks of 4 steps on 10,000 elements, one stall trial per signal")
    args = parser.parse_args()
    if args.smoke:
        args.numel, args.steps, args.blocks, args.warmup, args.trials = 10_000, 4, 2, 1, 1
    report: dict[str, object] = {}
    if args.only in (None, "overhead"):
        report["overhead"] = overhead(args)
    if args.only in (None, "stall"):
        report["stall_sigkill"] = stall(args, signal.SIGKILL)
        report["stall_sigstop"] = stall(args, signal.SIGSTOP)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'measure':<28}{'value':>12}{'target':>10}")
    if "overhead" in report:
        o = report["overhead"]
        print(f"{'baseline step (median)':<28}{o['baseline_median_s'] * 1000:>10.1f}ms")
        print(f"{'baseline flat (median)':<28}{o['baseline_flat_median_s'] * 1000:>10.1f}ms")
        print(f"{'fthsdp step (median)':<28}{o['fthsdp_median_s'] * 1000:>10.1f}ms")
        print(f"{'ratio vs per-tensor':<28}{o['ratio']:>12.3f}{'<= 1.02':>10}")
        print(f"{'ratio vs flat':<28}{o['ratio_vs_flat']:>12.3f}{'<= 1.02':>10}")
    for key in ("stall_sigkill", "stall_sigstop"):
        if key in report:
            s = report[key]
            print(f"{key + ' median':<28}{s['median_s']:>11.2f}s{'<= ' + format(s['target_s'], '.1f'):>10}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
