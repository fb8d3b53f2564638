"""The Accelerate loop of the tests: an MLP on generated regression data, FSDP2 inside the group (under
``tests/accelerate/cpu_fsdp.py``), ``FaultTolerantHSDP`` across groups; run by ``fthsdp launch --script``.

The learning rate follows ``LambdaLR(1 / (1 + 0.1 k))`` of the committed step count ``k`` (what the tests check the
commit records' ``lr`` against); ``--ballast-mib`` registers extra catch-up state so that a restarted group's transfer
outlasts steps (it follows, then replays them); ``--step-time-ms`` pads each step (with ``--pace-file``, only while
that file exists). At the end the group's rank 0 prints ``saved: <path or None>`` for ``accelerator.save_state``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from torch import nn
from torch.utils.data import TensorDataset

from lightning_fthsdp.accelerate import FaultTolerantHSDP

LR = 1e-2
FEATURES = 16


def lr_factor(committed_steps: int) -> float:
    return 1.0 / (1.0 + 0.1 * committed_steps)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = (x @ torch.linspace(-1.0, 1.0, FEATURES)).tanh().unsqueeze(1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--ballast-mib", type=int, default=0)
    parser.add_argument("--step-time-ms", type=int, default=0)
    parser.add_argument("--pace-file", default=None)
    parser.add_argument("--save-dir", default=None)
    args = parser.parse_args()

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False)
    set_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer = accelerator.prepare(model, optimizer)
    ft = FaultTolerantHSDP(accelerator, model, optimizer, scheduler=scheduler, dataset=dataset(args.samples),
                           batch_size=args.batch_size, max_grad_norm=1.0)
    if args.ballast_mib:
        ballast = {"ballast": torch.zeros(args.ballast_mib << 18)}  # float32: 2**18 elements per MiB
        ft.manager.register_state("ballast", lambda: ballast, lambda tree: ballast["ballast"].copy_(tree["ballast"]))
    with ft:
        started = time.monotonic()
        for x, y in ft.batches():
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if args.pace_file is None or os.path.exists(args.pace_file):
                        time.sleep(max(0.0, args.step_time_ms / 1000 - (time.monotonic() - started)))
                    ft.sync_gradients()
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the helper's norm: it clipped already
                    started = time.monotonic()
                optimizer.step()
                optimizer.zero_grad()
            if ft.step >= args.steps:
                break
        saved = accelerator.save_state(args.save_dir) if args.save_dir else None
    if accelerator.is_main_process:
        print(f"saved: {saved}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
