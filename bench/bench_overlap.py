"""Overlap benchmark: the cross-group exchange hidden under backward, against plain HSDP over the same slow link.

    python bench/bench_overlap.py                      # writes bench/results/overlap.json

Two replica groups of one rank each, each on a host of its own (``lightning_fthsdp.netcluster``: network namespaces
on a bridge), both hosts' links limited to ``--rate`` (tc ``tbf``, both directions); the lighthouse on a third host.
An MLP of ``--layers`` square layers of ``--width`` trains ``--steps`` steps (the first ``--warmup`` not counted) in
each mode, the median step of group a:

- compute: one process alone, no exchange (what the step costs without any);
- plain HSDP: no fault tolerance; FSDP2 on a 2-D device mesh (replicate across the two hosts, shard inside: 1), whose
  all-reduce across the replicas runs inside backward, unit by unit (the baseline);
- after backward: FT-HSDP exchanging once backward has ended (``overlap_exchange=False``);
- overlapped: FT-HSDP starting each bucket of the exchange as backward produces it (``manager.overlap``).

Printed: each mode's median step and its ratio to plain HSDP (target: overlapped <= 1.05), and the exchange's share
of plain HSDP's step (1 - compute / plain HSDP; the setting wants it >= 1/3). Where namespaces cannot be made (not
root, no ``ip``), it runs on loopback without a rate limit and says so: the exchange then costs little and the
difference cannot show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "overlap.json"
MODES = ("compute", "plain_hsdp", "after_backward", "overlapped")
TARGET = 1.05


def build_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def worker(args: argparse.Namespace) -> None:
    """One group's process in ``args.mode``: trains and prints its step times (JSON) on its last line."""
    torch.set_num_threads(1)
    model = build_model(args.width, args.layers)
    generator = torch.Generator().manual_seed(args.rank)
    batches = [torch.randn(args.batch, args.width, generator=generator) for _ in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times: list[float] = []
    if args.mode in ("compute", "plain_hsdp"):
        if args.mode == "plain_hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            store = dist.TCPStore(args.store_host, args.store_port, is_master=args.rank == 0 and not args.store_client,
                                  wait_for_workers=False)
            dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2)
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(args.steps):
            started = time.perf_counter()
            model(batches[step % 4]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    else:
        from lightning_fthsdp.manager import FTManager, StepDriver

        manager = FTManager(replica_id=args.replica_id, lighthouse=args.lighthouse, backend="gloo",
                           advertise_host=args.advertise_host, bucket_bytes=args.bucket_kib << 10)
        driver = StepDriver(manager)
        params = list(model.parameters())
        try:
            while manager.step < args.steps:
                started = time.perf_counter()
                manager.begin_step()
                loss = model(batches[manager.step % 4]).square().mean()
                if args.mode == "overlapped":
                    driver.before_backward(params)
                loss.backward()
                driver.until_committed(params)
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                times.append(time.perf_counter() - started)
        finally:
            driver.close()
            manager.shutdown()
    print(json.dumps({"times": times}), flush=True)


class Hosts:
    """Where the processes run: a netcluster of hosts a, b and lighthouse with slow links, or loopback."""

    def __init__(self, rate: str) -> None:
        from lightning_fthsdp.netcluster import cluster as netcluster
        from lightning_fthsdp.netcluster import faults

        self.note = netcluster.available()
        self.cluster = None if self.note else netcluster.Cluster(["lighthouse", "a", "b"], prefix="fthsdp_ovl")
        self._links = [faults.slowlink(self.cluster, host, rate) for host in ("a", "b")] if self.cluster else []

    def address(self, host: str) -> str:
        return self.cluster.address(host) if self.cluster else "127.0.0.1"

    def popen(self, host: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        if self.cluster:
            return self.cluster.popen(host, argv, env=env, stdout=subprocess.PIPE, text=True)
        return subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)

    def port(self, host: str) -> int:
        """A port for plain HSDP's store on ``host`` (reserved on a netcluster host; loopback: bound at 0 and kept
        by the caller instead, see ``run_mode``)."""
        assert self.cluster is not None
        return self.cluster.reserve_port(host)

    def close(self) -> None:
        for link in self._links:
            link.heal()
        if self.cluster:
            self.cluster.close()


def run_mode(mode: str, args: argparse.Namespace, hosts: Hosts, workdir: Path) -> list[float]:
    """Group a's step times in ``mode``."""
    from lightning_fthsdp.config.timeouts import Timeouts
    from lightning_fthsdp.launch.processes import Job

    common = [sys.executable, __file__, "--worker", mode, "--width", str(args.width), "--layers", str(args.layers),
              "--batch", str(args.batch), "--steps", str(args.steps), "--bucket-kib", str(args.bucket_kib)]
    env: dict[str, str] = {}
    job = None
    keep = None
    if mode == "plain_hsdp":
        if hosts.cluster:
            store_host, store_port = hosts.address("a"), hosts.port("a")
            extra = [["--store-host", store_host, "--store-port", str(store_port)]] * 2
        else:  # the store in this process, its port bound at 0 and kept; both workers connect to it
            keep = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            extra = [["--store-host", "127.0.0.1", "--store-port", str(keep.port), "--store-client"]] * 2
    elif mode != "compute":
        job = Job(workdir / mode, min_replicas=2, hosts=hosts.cluster,
                  heartbeat_timeout_ms=Timeouts().heartbeat_timeout_ms)  # what the workers' FTManager expects
        (workdir / mode).mkdir(parents=True)
        lighthouse = job.start_lighthouse()
        env = {"FTHSDP_TOKEN": job.token or ""}
        extra = [["--lighthouse", lighthouse, "--replica-id", host, "--advertise-host", hosts.address(host)]
                 for host in ("a", "b")]
    else:
        extra = [[]]
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank, host in enumerate(("a", "b")[:len(extra)]):
            procs.append(hosts.popen(host, [*common, "--rank", str(rank), *extra[rank]], env))
        outputs = [proc.communicate(timeout=args.timeout_s)[0] for proc in procs]
        for proc, out in zip(procs, outputs, strict=True):
            if proc.returncode != 0:
                raise RuntimeError(f"bench_overlap: a {mode} worker exited {proc.returncode}:\n{out[-2000:]}")
        return json.loads(outputs[0].strip().splitlines()[-1])["times"]
    finally:
        for proc in procs:  # ours, still running only when the mode failed or ran past --timeout-s
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if job is not None:
            job.close()
        del keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--replica-id", default="a", help=argparse.SUPPRESS)
    parser.add_argument("--advertise-host", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=768, help="the MLP's width")
    parser.add_argument("--layers", type=int, default=8, help="the MLP's layers")
    parser.add_argument("--batch", type=int, default=1024, help="samples per step")
    parser.add_argument("--steps", type=int, default=30, help="steps per mode")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not counted")
    parser.add_argument("--rate", default="1gbit", help="each group host's link rate (tc units)")
    parser.add_argument("--bucket-kib", type=int, default=4096, help="the exchange's bucket size in KiB")
    parser.add_argument("--timeout-s", type=float, default=600, help="the longest one mode may run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: a small model, a few steps")
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    if args.smoke:
        args.width, args.layers, args.batch, args.steps, args.warmup, args.bucket_kib = 128, 4, 32, 8, 2, 64
        args.rate = "50mbit"
    hosts = Hosts(args.rate)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
            times = {mode: run_mode(mode, args, hosts, Path(tmp)) for mode in MODES}
    finally:
        hosts.close()
    medians = {mode: statistics.median(t[args.warmup:]) for mode, t in times.items()}
    ratios = {mode: round(medians[mode] / medians["plain_hsdp"], 3) for mode in MODES}
    share = 1 - medians["compute"] / medians["plain_hsdp"]
    params = sum(p.numel() for p in build_model(args.width, args.layers).parameters())
    where = f"hosts of their own, links at {args.rate}" if hosts.cluster else f"loopback, no rate limit ({hosts.note})"
    print(f"{args.layers} x {args.width} MLP ({params * 4 / 2**20:.1f} MiB of fp32 gradients), batch {args.batch}, "
          f"{args.steps - args.warmup} steps counted; {where}")
    print(f"{'mode':>16} {'median step ms':>15} {'vs plain HSDP':>14}")
    for mode in MODES:
        print(f"{mode:>16} {medians[mode] * 1000:>15.1f} {ratios[mode]:>14.3f}")
    print(f"the exchange's share of plain HSDP's step: {share:.2f} (wanted >= 0.33); overlapped vs plain HSDP: "
          f"{ratios['overlapped']:.3f} (target <= {TARGET})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "torch": torch.__version__, "cpus": os.cpu_count(), "namespaces": hosts.cluster is not None,
        "note": hosts.note, "rate": args.rate, "width": args.width, "layers": args.layers, "batch": args.batch,
        "steps": args.steps, "warmup": args.warmup, "bucket_kib": args.bucket_kib, "gradient_mib": params * 4 / 2**20,
        "median_step_s": medians, "vs_plain_hsdp": ratios, "exchange_share": round(share, 3), "target": TARGET,
        "times_s": times}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
