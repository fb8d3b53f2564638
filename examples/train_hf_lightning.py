"""Fault-tolerant HSDP for a Hugging Face causal LM under Lightning: the LightningModule you would write around a
``transformers`` model, a plain ``Trainer(strategy="fthsdp")``, and no fault-tolerance code of your own.

``fthsdp launch`` starts the lighthouse and one launch per replica group, kills one and reports::

    fthsdp launch --script examples/train_hf_lightning.py --replicas 2 --shard-count 2 \\
        --chaos kill:at=step40:group=b -- --steps 150 --arch gpt2 --min-step-time-s 0.5

The strategy takes every setting from the environment the launcher sets (``FTHSDP_*``, and torchrun's ``RANK``,
``WORLD_SIZE``, ... for the group's ranks: ``--devices`` defaults to ``$LOCAL_WORLD_SIZE``). The model is
``transformers``' own ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (``examples/hf_models.py``), sharded by the
strategy's policy (each decoder layer an FSDP unit, GPT-2's tied embedding and head in the root). Needs the ``hf``
and ``lightning`` extras.

``HFCausalLM`` is the module as you would write it. ``--min-step-time-s`` (demos on one machine: it gives a killed
group of this tiny model time to come back before the others finish) adds ``DemoPace`` to the Trainer's callbacks;
without it the Trainer has none of ours.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_fthsdp  # noqa: F401  (registers strategy="fthsdp")
from hf_models import MarkovTokens, StepPace, add_training_flags, causal_lm, warmup_cosine
from lightning_fthsdp.lightning import release_process_groups


class HFCausalLM(pl.LightningModule):
    """A ``transformers`` causal LM as a LightningModule: Hugging Face computes the loss (it shifts the labels)."""

    def __init__(self, arch: str = "llama", context: int = 32, steps: int = 150, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = causal_lm(arch, context)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(self.hparams.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DemoPace(Callback):
    """The demo's pacing (``--min-step-time-s``), kept out of the model: pads each training step."""

    def __init__(self, pace: StepPace) -> None:
        self.pace = pace

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.pace.step_ended()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        help="ranks of this replica group (default: $LOCAL_WORLD_SIZE, else 1)")
    add_training_flags(parser)
    StepPace.add_flags(parser)
    args = parser.parse_args()
    pace = StepPace.from_flags(parser, args)

    pl.seed_everything(0)  # every group builds the same initial weights
    module = HFCausalLM(args.arch, args.context, args.steps, args.lr)
    data = MarkovTokens(args.samples, args.context)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)  # the strategy splits it over the groups
    trainer = pl.Trainer(strategy="fthsdp", accelerator="auto", devices=args.devices, max_steps=args.steps,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[DemoPace(pace)] if pace is not None else [])
    trainer.fit(module, loader)
    loss = trainer.callback_metrics.get("train_loss")  # absent if this group trained no step (it only caught up)
    if trainer.is_global_zero and loss is not None:
        print(f"step {trainer.global_step}: loss {float(loss):.3f} (the data's floor: {data.floor:.3f})", flush=True)
    release_process_groups()  # torch's C++ teardown at interpreter exit now and then aborts a finished run


if __name__ == "__main__":
    main()
