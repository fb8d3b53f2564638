"""Fault-tolerant HSDP with Lightning: an ordinary LightningModule (no configure_model, no FT code), LightningCLI.

One launch per replica group (Lightning starts the group's ranks itself)::

    fthsdp lighthouse --port 29510 --min-replicas 1 &
    FTHSDP_REPLICA_ID=a python examples/train_lightning.py fit --trainer.strategy=fthsdp \\
        --trainer.strategy.init_args.replica_ids='[a,b]' --trainer.strategy.init_args.lighthouse=http://127.0.0.1:29510
    FTHSDP_REPLICA_ID=b python examples/train_lightning.py fit ...   # the same command, another MASTER_PORT

or the whole job with failures (the strategy writes the launch records ``fthsdp launch`` follows, docs/launch.md)::

    fthsdp launch --script examples/train_lightning.py --replicas 2 --shard-count 2 --chaos kill:at=step40:group=b \
        -- fit --trainer.strategy=fthsdp --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=150 \
        --trainer.logger=false --recorder.sleep_s=0.5

``--recorder.jsonl PATH`` makes every rank append one JSON line per committed step (``event: "commit"``: global step,
epoch, learning rate, this rank's parameter and buffer digests, the logged metrics, the group's stream position)
and one at the end of fit
(``event: "end"``); ``--recorder.params PATH`` saves the full parameters at the end (rank 0);
``--recorder.ballast_mib N`` registers N MiB of extra state per rank for catch-up to transfer.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fthsdp  # noqa: F401  (registers strategy="fthsdp")
from lightning_fthsdp.lightning import release_process_groups
from lightning_fthsdp.lightning.committed_step import CommittedStepCallback
from lightning_fthsdp.models.mlp import Regressor
from lightning_fthsdp.recovery.torch_state import local


class TinyRegressor(Regressor):
    """The recipes' residual MLP regressor plus an LR decay: a plain LightningModule that knows nothing of sharding
    or fault tolerance. ``schedule``: multiply the LR by ``lr_decay`` every optimizer step ("step"), every epoch
    ("epoch"), or when the training loss stops falling ("plateau", ReduceLROnPlateau)."""

    def __init__(self, features: int = 8, width: int = 16, blocks: int = 2, lr: float = 0.05,
                 lr_decay: float = 0.95, schedule: Literal["step", "epoch", "plateau"] = "step") -> None:
        super().__init__(features, width, blocks, lr)
        self.save_hyperparameters()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        decay = self.hparams.lr_decay
        if self.hparams.schedule == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=decay)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda count: decay**count)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.schedule}}


def make_dataset(samples: int, features: int, seed: int = 1) -> TensorDataset:
    """The same synthetic regression data in every process."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    y = torch.tanh(x @ torch.linspace(-1.0, 1.0, features)).unsqueeze(1)
    return TensorDataset(x, y)


class TinyData(pl.LightningDataModule):
    def __init__(self, samples: int = 512, features: int = 8, batch_size: int = 4, drop_last: bool = False) -> None:
        super().__init__()
        self.samples, self.features, self.batch_size = samples, features, batch_size
        self.drop_last = drop_last

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(self.samples, self.features), batch_size=self.batch_size, shuffle=True,
                          drop_last=self.drop_last)


class StepRecorder(CommittedStepCallback):
    """Writes what each rank committed, so tests check invariants from outside; ``sleep_s`` paces the steps, while
    ``pace_file`` exists if one is given (a test lets go of the pace by deleting it). Test and demo plumbing, kept
    out of the model: without its options it does nothing (no digests, no gather of the full parameters)."""

    def __init__(self, jsonl: str | None = None, params: str | None = None, sleep_s: float = 0.0,
                 pace_file: str | None = None, ballast_mib: int = 0) -> None:
        self.jsonl, self.params, self.sleep_s, self.pace_file = jsonl, params, sleep_s, pace_file
        self.ballast_mib = ballast_mib

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ballast_mib:
            # Extra state for catch-up to transfer (tests and benchmarks), through the strategy's registration API.
            ballast = torch.zeros(self.ballast_mib << 18)  # float32: 2**18 elements per MiB
            trainer.strategy.manager.register_state("ballast", lambda: {"t": ballast},
                                                    lambda tree: ballast.copy_(tree["t"]))

    def on_committed_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        if self.jsonl:
            self._write(trainer, self._commit_record(trainer, pl_module, batch, batch_idx))
        if self.sleep_s and (self.pace_file is None or os.path.exists(self.pace_file)):
            time.sleep(self.sleep_s)

    def _commit_record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                       batch_idx: int) -> dict[str, Any]:
        record = {"event": "commit", "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                  "batch_idx": batch_idx, "lr": trainer.optimizers[0].param_groups[0]["lr"],
                  "params_sha256": _digest(pl_module), "batch_sha256": _digest_tensors(batch),
                  "buffers_sha256": _digest_tensors(local(b) for b in pl_module.buffers()),
                  "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}}
        manager = getattr(trainer.strategy, "manager", None)  # None: another strategy (the benchmark's baseline)
        if manager is not None:
            quorum = manager.quorum
            record |= {"ft_step": manager.step, "stream_step": manager.next_batch_index,
                       "quorum": list(quorum.member_ids) if quorum else [], "participants": list(manager.participants),
                       "discarded": manager.discarded_steps,
                       "catch_up_log": manager.catch_up_log}
        return record

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.jsonl or self.params):
            return  # the same options on every rank of a group: all of them skip the gather below
        full = {name: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                for name, p in pl_module.named_parameters()}  # a collective inside the group: every rank calls it
        if self.params and trainer.global_rank == 0:
            torch.save(full, self.params)
        self._write(trainer, {"event": "end", "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                              "params_sha256": _digest_tensors(list(full.values()))})

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        if self.jsonl:
            record |= {"t": time.time(), "replica_id": os.environ.get("FTHSDP_REPLICA_ID"),
                       "rank": trainer.global_rank}
            with open(self.jsonl, "a") as sink:
                sink.write(json.dumps(record) + "\n")


def _digest(module: nn.Module) -> str:
    return _digest_tensors([local(p) for p in module.parameters()])


def _digest_tensors(tensors: Any) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class TinyCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(StepRecorder, "recorder")


def main() -> None:
    TinyCLI(TinyRegressor, TinyData, seed_everything_default=0, save_config_callback=None)
    release_process_groups()


if __name__ == "__main__":
    main()
