"""A residual MLP regressor on generated data: tiny and fast, for tests and smoke runs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fthsdp.models.held_out import held_out


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Regressor(pl.LightningModule):
    """MSE regression with SGD (momentum 0.9); knows nothing of sharding or fault tolerance."""

    def __init__(self, features: int = 8, width: int = 16, blocks: int = 2, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class RegressionData(pl.LightningDataModule):
    """x ~ N(0, 1), y = tanh(x . w) with w evenly spaced in [-1, 1]: the same data in every process (fixed seed);
    ``val_samples`` more samples are drawn after the training ones and held out for validation."""

    def __init__(self, samples: int = 512, features: int = 8, batch_size: int = 4, val_samples: int = 64) -> None:
        super().__init__()
        self.samples, self.features, self.batch_size = samples, features, batch_size
        self.val_samples = val_samples

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(self.samples + self.val_samples, self.features, generator=gen)
        y = torch.tanh(x @ torch.linspace(-1.0, 1.0, self.features)).unsqueeze(1)
        self._train, self._val = held_out(TensorDataset(x, y), self.val_samples, "val_samples")

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._val, batch_size=self.batch_size)
