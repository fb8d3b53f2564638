"""LightningModules written the ways people write them, none with ``configure_model`` or any fault-tolerance code.

Each trains on generated data from its own ``train_dataloader`` (the same in every process: fixed seeds). Run one
with ``fit_module.py fit --model=shapes.<Name>``; ``tests/lightning/test_shapes.py`` runs them as replica groups of
processes, ``test_shapes_in_process.py`` as one group in the test process.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16


def regression_data(samples: int = 64, seed: int = 1) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    y = torch.sin(x @ torch.linspace(-1.0, 1.0, FEATURES)).unsqueeze(1)
    return TensorDataset(x, y)


def token_data(samples: int = 64, length: int = 8, vocab: int = 32, seed: int = 2) -> TensorDataset:
    """Sequences that count up modulo ``vocab`` from a random start: the next token is learnable."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=gen)
    tokens = (start + torch.arange(length + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class DirectSubmodules(pl.LightningModule):
    """The most common shape: no ``forward``; ``training_step`` calls a submodule directly."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=4, shuffle=True)


class SelfAndSubmodules(DirectSubmodules):
    """``forward`` and a direct submodule call in the same step (a penalty on the hidden layer's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[1](self.net[0](x))
        return F.mse_loss(self(x), y) + 1e-3 * hidden.pow(2).mean()


class RootParameter(DirectSubmodules):
    """Parameters held by the LightningModule itself (a learned output scale and offset)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.scale = nn.Parameter(torch.full((1,), 0.5))
        self.offset = nn.Parameter(torch.zeros(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x) * self.scale + self.offset, y)


class TiedWeights(pl.LightningModule):
    """A tiny language model whose output head shares the embedding's weight."""

    def __init__(self, vocab: int = 32, dim: int = 16, lr: float = 0.02) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=4, shuffle=True)


class FrozenAndUnused(DirectSubmodules):
    """A frozen layer (``requires_grad=False``) and a layer no step ever uses, under AdamW with weight decay: a
    parameter without a gradient must be skipped by the optimizer, not decayed."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.frozen = nn.Linear(FEATURES, FEATURES)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(FEATURES, FEATURES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(self.frozen(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class BatchNormNet(pl.LightningModule):
    """BatchNorm between two layers: running statistics are buffers, updated by every forward in training mode."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=4, shuffle=True)


class ScheduledStep(DirectSubmodules):
    """A step-interval LR scheduler (with gradient accumulation and clipping set on the Trainer)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ValidatedAndLogged(DirectSubmodules):
    """A validation loop during fit and metrics logged with ``sync_dist=True``, in training and in validation."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(16, seed=9), batch_size=4)


class TwoOptimizersManual(pl.LightningModule):
    """Manual optimization with two optimizers, as GANs are written: each step updates one model, then the other,
    from losses that read both."""

    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.generator = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
        self.critic = nn.Sequential(nn.Linear(FEATURES + 1, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        gen_opt, critic_opt = self.optimizers()
        fake = self.generator(x)
        critic_loss = (self.critic(torch.cat([x, fake.detach()], 1)) - self.critic(torch.cat([x, y], 1))).mean()
        critic_opt.zero_grad()
        self.manual_backward(critic_loss)
        critic_opt.step()
        gen_loss = F.mse_loss(fake, y) - 0.1 * self.critic(torch.cat([x, fake], 1)).mean()
        gen_opt.zero_grad()
        self.manual_backward(gen_loss)
        gen_opt.step()
        self.log("gen_loss", gen_loss)

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=self.lr),
                torch.optim.SGD(self.critic.parameters(), lr=self.lr))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=4, shuffle=True)


class ManualOneOptimizer(DirectSubmodules):
    """Manual optimization of one optimizer, one step per ``training_step``; the refused variants below change it."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.step_on(super().training_step(batch, batch_idx))

    def step_on(self, loss: torch.Tensor) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class ManualScheduledZeroAfter(ManualOneOptimizer):
    """Manual optimization written the other common way: the gradients zeroed after the step, the module's own LR
    scheduler stepped in ``training_step`` (Lightning's docs show both), and the loss logged before the step and
    returned."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        self.log("lr", float(scheduler.get_last_lr()[0]))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


class ManualRootParameter(ManualOneOptimizer):
    """A parameter the LightningModule holds itself (refused without configure_model)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.step_on(F.mse_loss(self.net(x) * self.scale, y))


class ManualTwoStepsPerBatch(ManualOneOptimizer):
    """The optimizer stepped twice per batch (refused)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        for _ in range(2):
            super().training_step(batch, batch_idx)


class ManualSkipsSteps(ManualOneOptimizer):
    """The optimizer stepped every second batch, gradients accumulating in between (refused)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.manual_backward(F.mse_loss(self.net(x), y))
        if batch_idx % 2:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()


class RaisesOnFirstStep(DirectSubmodules):
    """A bug in the user's own ``training_step``: what they must see is that error, once per rank, and nothing of
    ours (the strategy's teardown runs after it)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise ValueError("the user's own bug in training_step")
