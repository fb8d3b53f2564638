"""Fault-tolerant HSDP for a Hugging Face causal LM in an Accelerate loop: the loop you would write for a
``transformers`` model, plus the few lines of ``FaultTolerantHSDP``.

``fthsdp launch`` starts the lighthouse and one launch per replica group, kills one and reports::

    fthsdp launch --script examples/train_hf_accelerate.py --replicas 2 --shard-count 2 \\
        --chaos kill:at=step40:group=b -- --steps 150 --arch gpt2 --min-step-time-s 0.5

The model is ``transformers``' own ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (``examples/hf_models.py``), sharded
with FSDP2 by Accelerate on GPUs. On a machine without GPUs the script passes ``Accelerator(cpu=True)``: the group's
ranks then join over gloo and Accelerate runs DDP inside the group (it enables FSDP for GPU-like devices only).
Needs the ``hf`` and ``accelerate`` extras.

The loop is the one you would write; the step marked "demo pacing" is not part of it: with
``--min-step-time-s`` (demos on one machine: it gives a killed group of this tiny model time to come back before the
others finish) it pads each optimizer step, without it it does nothing.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

from hf_models import MarkovTokens, StepPace, add_training_flags, causal_lm, warmup_cosine
from lightning_fthsdp.accelerate import FaultTolerantHSDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    add_training_flags(parser)
    StepPace.add_flags(parser)
    args = parser.parse_args()
    pace = StepPace.from_flags(parser, args)

    # Each decoder layer its own FSDP unit (the model's _no_split_modules), the rest, a tied head too, in the root.
    sharding = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=sharding,
                              gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False)
    set_seed(0)  # every group builds the same initial weights
    model = causal_lm(args.arch, args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    data = MarkovTokens(args.samples, args.context)

    ft = FaultTolerantHSDP(accelerator, model, optimizer, scheduler=scheduler, dataset=data,
                           batch_size=args.batch_size, max_grad_norm=1.0)  # replica id etc. from FTHSDP_*
    with ft:
        for batch in ft.batches():  # this group's own stream, exactly once, resumed after catch-up
            with accelerator.accumulate(model):
                loss = model(**batch).loss  # Hugging Face shifts the labels itself
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    ft.sync_gradients()  # cross-group exchange + commit vote, retried until committed
                optimizer.step()
                optimizer.zero_grad()
            if ft.step >= args.steps:
                break
            if pace is not None and accelerator.sync_gradients:
                pace.step_ended()  # demo pacing (--min-step-time-s), outside the training code
            if ft.step % 20 == 0 and accelerator.sync_gradients and accelerator.is_main_process:
                print(f"step {ft.step}: loss {loss.item():.3f} (the data's floor: {data.floor:.3f})", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
