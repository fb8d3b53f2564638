"""Straggler benchmark: the job's committed steps per second with one group at a third of the speed, the lighthouse's
straggler policy off against evict.

    python bench/bench_straggler.py            # every scenario, writes bench/results/straggler.json
    python bench/bench_straggler.py --smoke    # a short slow-compute run, off and evict (tests/integration runs it)

Three replica groups (a, b, c) of lightning_fthsdp.demo.train_plain against a real lighthouse; every step is padded to
``--step-time-ms`` of emulated compute and its exchange carries ``--exchange-mib`` more. Scenarios, each measured with
``--straggler-policy off`` and ``evict`` (``lighthouse.stragglers``) in the same run:

- **healthy**: all three at full speed, policy off: what a job without a straggler reaches (the baseline);
- **compute**: all of c's own work per step takes 3x as long (the trainer's ``--slowdown 3``: its padded compute,
  optimizer step and logging alike): every member waits for it each step;
- **link**: every group computes at full speed on a host of its own (``netcluster``: network namespaces), and c's
  host link is limited (``netcluster.faults.slowlink``) to the rate at which the exchange takes twice the step time
  of that scenario's healthy baseline (measured first, on the same hosts). Needs root and iproute2
  (``scripts/install_network.sh``); skipped, saying why, where namespaces are unavailable.

The job's rate: its committed step (the highest any group committed, from the groups' JSONL logs) over ``--seconds``
after a warm-up of ``--warmup`` steps, per second. Ratios: evict over off of the same scenario, and each rate over its
healthy baseline. The slow group is named last in id order, the last a link trial tries: the worst case for evict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = ("a", "b", "c")
SLOW = "c"
SLOWDOWN = 3
"""The slow group runs at 1/SLOWDOWN of the others' speed."""


def job_step_at(groups: dict[str, Group], t: float) -> int:
    """The job's committed step at wall time ``t``: the highest step any group had committed by then."""
    return max((r["step"] for g in groups.values() for r in g.records() if r["t"] <= t), default=0)


def events(job: Job) -> list[dict[str, Any]]:
    """The lighthouse's event log; with ``Job.hosts`` fetched from the lighthouse's host (this machine's own network
    does not reach the cluster's addresses)."""
    url, headers = f"{job.lighthouse_url}/events", job.auth_headers()
    if job.hosts is None:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return json.loads(response.read())["events"]
    from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE

    fetch = ("import json, sys, urllib.request; r = urllib.request.Request(sys.argv[1], headers=json.loads("
             "sys.argv[2])); sys.stdout.write(urllib.request.urlopen(r, timeout=10).read().decode())")
    done = job.hosts.run(LIGHTHOUSE, [sys.executable, "-c", fetch, url, json.dumps(headers)], capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(done.stdout)["events"]


def link_rate(args: argparse.Namespace, healthy_step_s: float) -> str:
    """The tc rate at which the exchange takes (SLOWDOWN - 1) healthy steps: a ring allreduce over n groups moves
    2 (n - 1) / n of the exchange through every member's link."""
    moved = 2 * (len(GROUPS) - 1) / len(GROUPS) * args.exchange_mib * (1 << 20)
    return f"{int(moved * 8 / ((SLOWDOWN - 1) * healthy_step_s))}bit"


def measure(scenario: str, policy: str, args: argparse.Namespace, rate: str = "") -> dict[str, Any]:
    """One job of the scenario under the policy (``rate``: c's link in the link scenario); its rate and what the
    lighthouse did about c."""
    cluster, fault = None, None
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep / f"{scenario}-{policy}" if args.keep is not None else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if scenario.startswith("link"):
            from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE, Cluster

            cluster = Cluster([LIGHTHOUSE, *GROUPS], prefix="fthsdpstrag")
        job = Job(workdir, min_replicas=2, heartbeat_timeout_ms=2_000, join_timeout_ms=2_000,
                  collective_timeout_ms=20_000, hosts=cluster,
                  straggler_policy=StragglerPolicy(policy, args.factor, args.window))
        try:
            if scenario == "link":
                from lightning_fthsdp.netcluster.faults import slowlink

                fault = slowlink(cluster, SLOW, rate)  # type: ignore[arg-type]
            job.start_lighthouse()
            # Only a slow link needs the bytes: without it they cost every scenario the same copies.
            extra = ("--exchange-mib", f"{args.exchange_mib:g}") if scenario.startswith("link") else ()
            groups = {rid: job.start_group(rid, 1_000_000, step_time_ms=args.step_time_ms, extra=extra + (
                ("--slowdown", str(SLOWDOWN)) if scenario == "compute" and rid == SLOW else ())) for rid in GROUPS}
            wait_for(lambda: job_step_at(groups, time.time()) >= args.warmup, 120,
                     f"the job to commit {args.warmup} steps")
            start = time.time()
            time.sleep(args.seconds)  # the span measured: the rate is read from the groups' logs afterwards
            end = time.time()
            seen = events(job)
        finally:
            job.close()
            if fault is not None:
                fault.heal()
            if cluster is not None:
                cluster.close()
        steps = job_step_at(groups, end) - job_step_at(groups, start)
    straggling = [e for e in seen if e["replica_id"] == SLOW and e["kind"] in ("straggler", "exclude", "readmit")]
    return {"scenario": scenario, "policy": policy, "steps": steps, "seconds": round(end - start, 3),
            "steps_per_s": steps / (end - start),
            "exclusions": sum(1 for e in seen if e["kind"] == "exclude"),
            "slow_excluded": sum(1 for e in straggling if e["kind"] == "exclude"),
            "trials": sum(1 for e in seen if e["kind"] == "exclude" and "whether its link" in e["text"]),
            "first_flag_s": next((round(e["t"] - start, 2) for e in straggling), None)}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rate = {(r["scenario"], r["policy"]): r["steps_per_s"] for r in rows}
    out = []
    for scenario, healthy in (("compute", "healthy"), ("link", "link_healthy")):
        if (scenario, "off") not in rate or (scenario, "evict") not in rate:
            continue
        off, evict = rate[scenario, "off"], rate[scenario, "evict"]
        base = rate.get((healthy, "off"))
        out.append({"scenario": scenario, "healthy_steps_per_s": base, "off_steps_per_s": off,
                    "evict_steps_per_s": evict, "evict_over_off": evict / off if off else None,
                    "off_over_healthy": off / base if base else None,
                    "evict_over_healthy": evict / base if base else None})
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    cols = list(dict.fromkeys(c for row in rows for c in row))
    print(" ".join(f"{c:>19}" for c in cols))
    for row in rows:
        cells = [row.get(c, "") for c in cols]
        print(" ".join(f"{v:>19.3f}" if isinstance(v, float) else f"{v!s:>19}" for v in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-time-ms", type=int, default=100, help="the healthy groups' step time")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured span of each job, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="steps the job commits before the span starts")
    parser.add_argument("--window", type=int, default=10, help="the straggler policy's window")
    parser.add_argument("--factor", type=float, default=2.0, help="the straggler policy's factor")
    parser.add_argument("--exchange-mib", type=float, default=1.0,
                        help="extra MiB in every step's exchange in the link scenarios (what a slow link slows)")
    parser.add_argument("--scenarios", nargs="+", default=["healthy", "compute", "link"],
                        choices=("healthy", "compute", "link"))
    parser.add_argument("--keep", type=Path, default=None, help="keep the processes' logs under this folder")
    parser.add_argument("--out", type=Path, default=RESULTS / "straggler.json", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run for CI: slow compute only, off and evict, short steps and span")
    args = parser.parse_args(argv)
    if args.smoke:
        args.step_time_ms, args.seconds, args.warmup, args.window, args.scenarios = 40, 5.0, 3, 5, ["compute"]
    runs: list[tuple[str, str]] = []
    skipped: dict[str, str] = {}
    for scenario in args.scenarios:
        if scenario == "link":
            from lightning_fthsdp.netcluster.cluster import available

            reason = available()
            if reason is not None:
                skipped["link"] = reason
                print(f"skipping the slow-link scenario: {reason}")
                continue
            runs += [("link_healthy", "off"), ("link", "off"), ("link", "evict")]
        elif scenario == "healthy":
            runs.append(("healthy", "off"))
        else:
            runs += [(scenario, "off"), (scenario, "evict")]
    rows = []
    rate = ""
    for scenario, policy in runs:
        row = measure(scenario, policy, args, rate)
        if scenario == "link_healthy":
            rate = link_rate(args, 1 / row["steps_per_s"])
            row["link_rate"] = rate
        print(f"{scenario:>12} {policy:>5}: {row['steps_per_s']:.2f} steps/s ({row['steps']} steps in "
              f"{row['seconds']:.1f} s; c excluded {row['slow_excluded']} times, trials {row['trials']})", flush=True)
        rows.append(row)
    summary = summarise(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "runs": rows, "summary": summary, "skipped": skipped},
                                   indent=2))
    print()
    _print(rows)
    if summary:
        print()
        _print(summary)
    print(f"evict_over_off: the job's committed steps/s with the straggler policy evict over off; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
