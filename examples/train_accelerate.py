"""Fault-tolerant HSDP with Hugging Face Accelerate: an ordinary Accelerate loop, a small byte-level causal LM on the
Python standard library's own source text, and the few lines of ``FaultTolerantHSDP``.

One Accelerate launch (or torchrun) per replica group; ``fthsdp launch`` starts them all, kills some and reports::

    fthsdp launch --script examples/train_accelerate.py --replicas 3 --shard-count 2 --chaos kill:every=20s \\
        -- --steps 300

or by hand, one launch per group::

    fthsdp lighthouse --port 29510 --min-replicas 1 &
    FTHSDP_REPLICA_ID=a FTHSDP_REPLICAS=2 FTHSDP_REPLICA_INDEX=0 FTHSDP_LIGHTHOUSE=http://127.0.0.1:29510 \\
        accelerate launch --num_processes 2 --master_port 29601 examples/train_accelerate.py
    FTHSDP_REPLICA_ID=b FTHSDP_REPLICAS=2 FTHSDP_REPLICA_INDEX=1 ...  --master_port 29602 ...

FSDP2 inside a group needs GPUs (Accelerate enables FSDP for GPU-like devices only). On a machine without an
accelerator the script passes ``Accelerator(cpu=True)`` itself (what ``accelerate launch --cpu`` sets): the group's
ranks run DDP over gloo instead, and the commands above run unchanged.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from torch import nn
from torch.utils.data import Dataset

from lightning_fthsdp.accelerate import FaultTolerantHSDP


class SourceText(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``context + 1`` bytes of the standard library's ``*.py`` files (sorted: the same in every group)."""

    def __init__(self, max_bytes: int, context: int) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        text = bytearray()
        for path in sorted(root.glob("*.py")):
            if len(text) >= max_bytes:
                break
            text += path.read_bytes()
        self.tokens = torch.tensor(text[:max_bytes], dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.context:(index + 1) * self.context + 1]
        return window[:-1], window[1:]


class TinyCausalLM(nn.Module):
    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[:tokens.shape[1]]
        return self.head(self.blocks(hidden, mask=self.mask, is_causal=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="train until this many committed steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and rank")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--corpus-kb", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    # Without cpu=True on a machine without GPUs, Accelerate takes each of torchrun's processes for a world of its own.
    accelerator = Accelerator(cpu=not torch.accelerator.is_available(),
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False)
    set_seed(0)  # every group starts from the same weights
    model = TinyCausalLM(args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)

    def warmup_then_cosine(k: int) -> float:
        return min(1.0, (k + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(k, args.steps) / args.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    model, optimizer = accelerator.prepare(model, optimizer)
    train_ds = SourceText(args.corpus_kb << 10, args.context)

    ft = FaultTolerantHSDP(accelerator, model, optimizer, scheduler=scheduler, dataset=train_ds,
                           batch_size=args.batch_size, max_grad_norm=1.0)  # replica id etc. from FTHSDP_*
    with ft:
        for tokens, targets in ft.batches():  # this group's own stream, exactly once, resumed after catch-up
            with accelerator.accumulate(model):
                logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    ft.sync_gradients()  # cross-group exchange + commit vote, retried until committed
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # clipping sees the average
                optimizer.step()
                optimizer.zero_grad()
            if ft.step >= args.steps:
                break
            if ft.step % 20 == 0 and accelerator.sync_gradients and accelerator.is_main_process:
                print(f"step {ft.step}: loss {loss.item():.3f}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
