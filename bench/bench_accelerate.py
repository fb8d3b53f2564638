"""Step time of an Accelerate FSDP2 loop with ``FaultTolerantHSDP`` against the same loop without it, one group.

One launch of ``--shard-count`` ranks and a lighthouse; every rank runs, in one process and on one prepared model,
``--steps`` plain Accelerate steps, then as many with the helper (its exchange with itself, the commit vote, the quorum
request overlapped with compute, the copy kept for a retry) and as many again under ``torch.profiler`` (untimed: the
milliseconds per step of each of the helper's ranges, ``config.ranges``, inclusive: the vote is inside the commit), then
the plain loop again (plain = the mean of both plain blocks, so drift over the run cancels). A step is ``--accumulate``
micro-batches, backward, clipping and the optimizer step; its time is rank 0's mean after ``--warmup`` steps of each
block, and so is each of its phases (``PHASES``, timed alike in both loops): the table shows where the helper's extra
milliseconds go, and how much of them is CPU time of the step's own thread (the rest is waiting: for the other rank, for
the GIL while the helper's threads run Python, for a core). A step's wall time here varies by a fifth from step to
step, so a block is 100 steps by default. On a machine without CUDA, Accelerate's FSDP2 path is enabled on CPU by
the tests' fixture (``tests/accelerate/cpu_fsdp.py``). CPU timings say nothing of GPU speed: compare the ratio only.
Prints a table, writes bench/results/accelerate.json::

    .venv/bin/python bench/bench_accelerate.py

``--smoke``: blocks of 6 steps, 2 of them warm-up, width 64 (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCKS, BATCH, FEATURES, SAMPLES = 4, 32, 64, 1 << 14


def worker(args: argparse.Namespace) -> None:
    """One rank: the four blocks of steps; rank 0 writes the step times to ``args.result``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, send_to_device, set_seed
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_fthsdp.accelerate import FaultTolerantHSDP
    from lightning_fthsdp.config.ranges import RANGES

    if not torch.cuda.is_available():
        sys.path.insert(0, str(ROOT))
        from tests.accelerate.cpu_fsdp import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False)
    set_seed(0)
    width = args.width
    layers: list[nn.Module] = [nn.Linear(FEATURES, width), nn.GELU()]
    for _ in range(BLOCKS):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1.0 + 0.01 * k))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=generator), torch.randn(SAMPLES, 1,
                                                                                          generator=generator))
    # The same reads as the helper's stream (indexing the dataset, default collate), so only the helper differs.
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(
        data, num_replicas=accelerator.num_processes, rank=accelerator.process_index, shuffle=True, seed=0))
    model, optimizer = accelerator.prepare(model, optimizer)

    def timed(batches: Iterator[Any], gradients: Callable[[], object], stepped: Callable[[], object]
              ) -> dict[str, list[float]]:
        """``args.steps`` steps of the loop, each phase timed; ``gradients()`` runs where the step's gradients are
        ready, ``stepped()`` after its optimizer step."""
        phases, clock = Phases(), time.perf_counter()
        for x, y in batches:
            clock = phases.add("batches", clock)
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                clock = phases.add("forward_backward", clock)
                if accelerator.sync_gradients:
                    gradients()
                clock = phases.add("gradients", clock)
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    stepped()
                clock = phases.add("optimizer", clock)
                if accelerator.sync_gradients:
                    phases.step_ended()
            if phases.steps == args.steps:
                break
        return phases.per_step

    def plain() -> dict[str, list[float]]:
        return timed((send_to_device(batch, accelerator.device) for batch in forever(loader)),
                     lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0), scheduler.step)

    def fault_tolerant(ft: FaultTolerantHSDP, batches: Iterator[Any]) -> dict[str, list[float]]:
        return timed(batches, ft.sync_gradients, lambda: None)  # the helper steps the scheduler itself

    blocks: dict[str, Any] = {"plain_before": plain()}
    ft = FaultTolerantHSDP(accelerator, model, optimizer, scheduler=scheduler, dataset=data, batch_size=BATCH,
                           max_grad_norm=1.0, replica_id="a", replicas=1)
    with ft:
        batches = iter(ft.batches())
        blocks["fthsdp"] = fault_tolerant(ft, batches)
        # The same steps again under the profiler, apart from the timed ones (it records every op, which slows the
        # step): how much of a step each of the fault-tolerant path's ranges takes (config.ranges).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiled = len(fault_tolerant(ft, batches)["step"])
    blocks["ranges_ms"] = {event.key: event.cpu_time_total / 1000 / profiled for event in prof.key_averages()
                           if event.key in RANGES}
    blocks["plain_after"] = plain()
    if accelerator.is_main_process:
        Path(args.result).write_text(json.dumps(blocks))
    accelerator.end_training()


PHASES = {"batches": "batches (helper: its stream, the quorum request sent)",
          "forward_backward": "forward, backward (helper: quorum agreed, exchange)",
          "gradients": "gradients (helper: exchange's end, vote; clipping)",
          "optimizer": "optimizer step"}
"""The parts of a step both loops time alike (their sum is the step), with what the helper does in each: it sends the
step's quorum request as the first micro-batch is drawn, agrees on the quorum as backward starts and starts the
exchange during it, and in ``sync_gradients`` waits for the exchange, votes on the commit and clips."""
CPU_PHASES = {name: f"cpu_{name}" for name in PHASES}
"""Where ``Phases`` keeps the CPU time of the step's thread in each phase."""


class Phases:
    """Wall time per phase of each step (``PHASES``), and of the whole step (``step``); and the CPU time the step's own
    thread spent in each phase (``cpu_<phase>``): the wall time a phase has beyond it is waiting (for a peer, for the
    GIL while another thread of the process runs Python, for a core). What counts is this thread's alone: torch's own
    worker threads are not counted, and on a GPU a thread spinning in a stream synchronize counts as CPU."""

    def __init__(self) -> None:
        self.per_step: dict[str, list[float]] = {name: [] for name in (*PHASES, *CPU_PHASES.values(), "step")}
        self._current = dict.fromkeys(PHASES, 0.0)
        self._cpu = dict.fromkeys(PHASES, 0.0)
        self._cpu_clock = time.thread_time()

    @property
    def steps(self) -> int:
        return len(self.per_step["step"])

    def add(self, phase: str, since: float) -> float:
        """The time from ``since`` to now was ``phase``'s (and this thread's CPU time since the last ``add``); returns
        now."""
        now, cpu = time.perf_counter(), time.thread_time()
        self._current[phase] += now - since
        self._cpu[phase] += cpu - self._cpu_clock
        self._cpu_clock = cpu
        return now

    def step_ended(self) -> None:
        for name, seconds in self._current.items():
            self.per_step[name].append(seconds)
            self.per_step[CPU_PHASES[name]].append(self._cpu[name])
        self.per_step["step"].append(sum(self._current.values()))
        self._current = dict.fromkeys(PHASES, 0.0)
        self._cpu = dict.fromkeys(PHASES, 0.0)


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def mean_after(times: list[float], warmup: int) -> float:
    kept = times[warmup:]
    return sum(kept) / len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per block (four blocks)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each block left out of its mean")
    parser.add_argument("--shard-count", type=int, default=2, help="ranks of the group (FSDP2 over them)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=512,
                        help="the MLP's width (the step's compute grows with its square, the helper's cost hardly)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "accelerate.json",
                        help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run for CI: blocks of 6 steps, 2 of them warm-up, width 64")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.width = 6, 2, 64
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.worker:
        from lightning_fthsdp.lightning import release_process_groups

        worker(args)
        # Torch's C++ teardown at interpreter exit now and then aborts a rank that finished (-6, seen under load).
        release_process_groups()

    from lightning_fthsdp.launch.processes import Job

    with tempfile.TemporaryDirectory() as tmp:
        workdir, result = Path(tmp), Path(tmp) / "result.json"
        job = Job(workdir, min_replicas=1)
        try:
            url = job.start_lighthouse()
            cmd = [sys.executable, "-m", "lightning_fthsdp.launch.ranks", str(args.shard_count), __file__, "--worker",
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--accumulate", str(args.accumulate),
                   "--width", str(args.width), "--result", str(result)]
            env = {"FTHSDP_LIGHTHOUSE": url}
            group = job.start_command("a", cmd, jsonl=workdir / "a.jsonl", log=workdir / "a.log", env=env)
            if job.wait_exit(group, 600) != 0:
                raise SystemExit(f"bench_accelerate: the group failed:\n{group.log.read_text()[-3000:]}")
        finally:
            job.close()
        blocks = json.loads(result.read_text())
    before = mean_after(blocks["plain_before"]["step"], args.warmup)
    after = mean_after(blocks["plain_after"]["step"], args.warmup)
    plain = (before + after) / 2
    fthsdp = mean_after(blocks["fthsdp"]["step"], args.warmup)

    def per_step_ms(name: str) -> dict[str, float]:
        """``name``'s milliseconds per step: plain (the mean of both plain blocks) and with the helper."""
        return {"plain": 500 * (mean_after(blocks["plain_before"][name], args.warmup)
                                + mean_after(blocks["plain_after"][name], args.warmup)),
                "fthsdp": 1000 * mean_after(blocks["fthsdp"][name], args.warmup)}

    phases_ms = {name: per_step_ms(name) for name in PHASES}
    phases_cpu_ms = {name: per_step_ms(CPU_PHASES[name]) for name in PHASES}
    report = {"shard_count": args.shard_count, "accumulate": args.accumulate,
              "model": {"width": args.width, "blocks": BLOCKS, "batch_per_rank": BATCH}, "steps": args.steps,
              "warmup": args.warmup, "plain_before_step_s": before, "plain_after_step_s": after,
              "plain_step_s": plain, "fthsdp_step_s": fthsdp, "ratio": fthsdp / plain,
              "phases_ms_per_step": phases_ms, "phases_cpu_ms_per_step": phases_cpu_ms,
              "ranges_ms_per_step": blocks["ranges_ms"],
              "target": 1.05, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{'Accelerate FSDP2 loop, 1 group x ' + str(args.shard_count) + ' ranks':<44} {'step (ms)':>10}")
    print(f"{'without the helper, first block':<44} {before * 1000:>10.1f}")
    print(f"{'without the helper, last block':<44} {after * 1000:>10.1f}")
    print(f"{'without the helper (mean of both blocks)':<44} {plain * 1000:>10.1f}")
    print(f"{'with FaultTolerantHSDP':<44} {fthsdp * 1000:>10.1f}")
    print(f"{'ratio (target <= 1.05)':<44} {fthsdp / plain:>10.3f}")
    print(f"\n{'where a step goes, timed alike in both loops (ms)':<54} {'plain':>8} {'helper':>8} {'extra':>8}"
          f" {'extra CPU':>10}")
    for name, label in PHASES.items():
        times, cpu = phases_ms[name], phases_cpu_ms[name]
        print(f"{label:<54} {times['plain']:>8.2f} {times['fthsdp']:>8.2f} {times['fthsdp'] - times['plain']:>+8.2f}"
              f" {cpu['fthsdp'] - cpu['plain']:>+10.2f}")
    print("(extra CPU: the step's own thread's; the rest of a phase's extra is waiting: for the other rank, for the "
          "GIL while the helper's threads run, for a core)")
    print(f"\n{'the helper ranges (a profiled block; inclusive)':<44} {'ms/step':>10}")
    for name, ms in sorted(blocks["ranges_ms"].items(), key=lambda item: -item[1]):
        print(f"{name:<44} {ms:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the repository
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
