"""``fthsdp demo``: the local fault-injection demo.

A real lighthouse and three replica groups of ``lightning_fthsdp.demo.train_plain`` train together on loopback;
group b is killed with SIGKILL mid-run, restarted with the same command, catches up from a healthy group, and every
group ends with bit-identical parameters. Prints what happened and exits non-zero if any invariant failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from lightning_fthsdp.protocol.records import RecordKind


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("demo", help="run the local fault-injection demo (3 groups, one killed)",
                                   description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="committed steps every group trains")
    parser.add_argument("--kill-at", type=int, default=60, help="SIGKILL group b once it committed this step")
    parser.add_argument("--restart-after-s", type=float, default=2.0, help="restart b this long after the kill")
    parser.add_argument("--step-time-ms", type=int, default=40, help="pace of each step")
    parser.add_argument("--out", type=Path, default=None, help="keep logs and JSONL here (default: a temp dir)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.launch.processes import Job, wait_for

    workdir = args.out or Path(tempfile.mkdtemp(prefix="fthsdp-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    job = Job(workdir, min_replicas=2)
    try:
        print(f"lighthouse: {job.start_lighthouse()}  (logs in {workdir})", flush=True)
        groups = {r: job.start_group(r, args.steps, step_time_ms=args.step_time_ms) for r in "abc"}
        b = groups["b"]
        wait_for(lambda: b.last_step() >= args.kill_at, 300, f"b to commit step {args.kill_at}")
        killed_at = time.time()
        os.killpg(b.proc.pid, signal.SIGKILL)
        b.proc.wait(timeout=30)
        print(f"t={0.0:6.2f}s  SIGKILL group b at step {b.last_step()}", flush=True)
        a = groups["a"]
        resumed = wait_for(lambda: [r for r in a.records() if r["t"] > killed_at and r["participants"] == 2],
                           60, "a and c to commit without b")[0]
        print(f"t={resumed['t'] - killed_at:6.2f}s  a and c continue without b (step {resumed['step']})", flush=True)
        time.sleep(args.restart_after_s)  # the pause a real restart takes; nothing waits on it
        print(f"t={time.time() - killed_at:6.2f}s  restart group b with the same command", flush=True)
        b = groups["b"] = job.start_group("b", args.steps, step_time_ms=args.step_time_ms)
        back = wait_for(lambda: [r for r in a.records() if r["t"] > killed_at and r["participants"] == 3],
                        120, "b to catch up and contribute again")[0]
        print(f"t={back['t'] - killed_at:6.2f}s  b caught up; 3 groups contribute again (step {back['step']})",
              flush=True)
        codes = {r: job.wait_exit(g, 300) for r, g in groups.items()}
        return _summary(groups, codes, args.steps)
    finally:
        job.close()


def _summary(groups: dict, codes: dict[str, int], steps: int) -> int:  # type: ignore[type-arg]
    finals = {r: g.records()[-1] for r, g in groups.items() if g.records()}
    print("\ngroup  exit  final step  discarded  first loss  last loss  params_sha256")
    for r, g in groups.items():
        commits = g.records()
        print(f"{r:<6} {codes[r]:>4} {finals[r]['step']:>11} {len(g.records(RecordKind.DISCARD)):>10} "
              f"{commits[0]['loss']:>11.4f} {commits[-1]['loss']:>10.4f}  {finals[r]['params_sha256'][:16]}")
    identical = len({f["params_sha256"] for f in finals.values()}) == 1
    done = all(f["step"] == steps for f in finals.values()) and all(c == 0 for c in codes.values())
    print(f"\nfinal parameters identical across groups: {identical}; every group reached step {steps}: {done}")
    return 0 if identical and done else 1
