"""Step time of FTHSDPStrategy against Lightning's ModelParallelStrategy with a 2-D HSDP mesh, fault-free.

Same model, same data, same 4 processes on this machine: fthsdp = 2 replica groups x 2 shard ranks (two Lightning
launches and a lighthouse); baseline = one launch of 4 ranks with ``fully_shard`` over a (dp_replicate=2,
dp_shard=2) mesh. The step time is the mean interval between rank 0's optimizer steps after a warm-up.
CPU timings say nothing of GPU speed: compare the ratio only. Prints a table, writes bench/results/lightning.json::

    .venv/bin/python bench/bench_lightning.py --steps 40

``--smoke``: 8 steps, 2 of them warm-up (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_fthsdp.config.env import ENV_TOKEN
from lightning_fthsdp.protocol.records import read_records

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

WIDTH, BLOCKS, BATCH, SAMPLES = 256, 4, 32, 1 << 14


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker(mode: str, steps: int, jsonl: str) -> None:
    """One Lightning launch (Lightning starts the other ranks by re-running this command)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    import lightning_fthsdp  # noqa: F401
    from train_lightning import StepRecorder, TinyData, TinyRegressor

    class HSDPRegressor(TinyRegressor):
        def configure_model(self) -> None:
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh)  # 2-D mesh: replicate over dim 0, shard over dim 1
            fully_shard(self, mesh=self.device_mesh)

    pl.seed_everything(0)
    if mode == "baseline":
        model: pl.LightningModule = HSDPRegressor(features=64, width=WIDTH, blocks=BLOCKS)
        strategy: object = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        devices = 4
    else:
        model = TinyRegressor(features=64, width=WIDTH, blocks=BLOCKS)
        strategy, devices = "fthsdp", 2
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[StepRecorder(jsonl=jsonl)])
    trainer.fit(model, TinyData(samples=SAMPLES, features=64, batch_size=BATCH))


def step_time(jsonl: Path, warmup: int) -> float:
    times = [r["t"] for r in read_records(jsonl)
             if r["event"] == "commit" and r["rank"] == 0 and r["global_step"] > warmup]
    if len(times) < 2:
        raise SystemExit(f"{jsonl.name}: {len(times)} steps recorded after the warm-up of {warmup}: run more --steps")
    return (times[-1] - times[0]) / (len(times) - 1)


def launch(mode: str, steps: int, workdir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """One Lightning launch of ``mode``; its process and its log."""
    name = f"{mode}-{env.get('FTHSDP_REPLICA_ID', 'all')}"
    jsonl, log = workdir / f"{name}.jsonl", workdir / f"{name}.log"
    cmd = [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--jsonl", str(jsonl)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), **env)
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), log


def finish(launched: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    """Wait for every launch; SystemExit with the log's end of the first that failed (the others are ended)."""
    deadline = time.monotonic() + 600
    while any(proc.poll() is None for proc, _ in launched):
        failed = [(proc, log) for proc, log in launched if proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc, log in launched:
        if proc.poll() not in (None, 0):
            for other, _ in launched:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{log.stem} exited {proc.returncode}; the end of its log:\n{tail}")
    if any(proc.poll() is None for proc, _ in launched):
        for proc, _ in launched:
            proc.kill()
            proc.wait()
        raise SystemExit("the launches did not end within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", choices=("fthsdp", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lightning.json",
                        help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 8 steps, 2 of them warm-up")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 8, 2
    if args.worker:
        worker(args.worker, args.steps, args.jsonl)
        return
    from lightning_fthsdp.launch.processes import Job

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        finish([launch("baseline", args.steps, workdir, {})])
        baseline = step_time(workdir / "baseline-all.jsonl", args.warmup)
        job = Job(workdir, min_replicas=2)
        try:
            url = job.start_lighthouse()
            finish([launch("fthsdp", args.steps, workdir, {
                "FTHSDP_REPLICA_ID": rid, "FTHSDP_LIGHTHOUSE": url, "FTHSDP_REPLICAS": "2",
                "FTHSDP_REPLICA_INDEX": str(ord(rid) - ord("a")), ENV_TOKEN: job.token or ""}) for rid in ("a", "b")])
        finally:
            job.close()
        fthsdp = step_time(workdir / "fthsdp-a.jsonl", args.warmup)
    result = {"processes": 4, "model": {"width": WIDTH, "blocks": BLOCKS, "batch_per_rank": BATCH},
              "steps": args.steps, "warmup": args.warmup, "baseline_step_s": baseline, "fthsdp_step_s": fthsdp,
              "ratio": fthsdp / baseline, "target": 1.05, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{'strategy':<44} {'step (ms)':>10}")
    print(f"{'ModelParallelStrategy, HSDP mesh (2, 2)':<44} {baseline * 1000:>10.1f}")
    print(f"{'FTHSDPStrategy, 2 groups x 2 ranks':<44} {fthsdp * 1000:>10.1f}")
    print(f"{'ratio (target <= 1.05)':<44} {fthsdp / baseline:>10.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the repository
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
