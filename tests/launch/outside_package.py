"""A LightningModule and LightningDataModule in a package of their own, written outside this repository for a test
(nothing of lightning_fthsdp in it), and recipes that name them in LightningCLI's form and in Hydra's."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "outside_models"

_SOURCE = '''"""A sine-wave regressor: the kind of module a user writes, with no fault-tolerance code in it."""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Wave(pl.LightningModule):
    def __init__(self, features: int = 4, hidden: int = 8, depth: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.ModuleList(nn.Linear(features if i == 0 else hidden, hidden) for i in range(depth))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.sin(layer(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class WaveData(pl.LightningDataModule):
    def __init__(self, features: int = 4, samples: int = 256, batch_size: int = 4) -> None:
        super().__init__()
        self.features, self.samples, self.batch_size = features, samples, batch_size

    def setup(self, stage: str) -> None:
        x = torch.randn(self.samples, self.features, generator=torch.Generator().manual_seed(3))
        self.dataset = TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)
'''

#: The recipe's model and data sections in each form (``{features}`` and friends filled in by ``write_recipe``).
FORMS = {
    "lightning": """model:
  class_path: outside_models.Wave
  init_args: {{features: 6, hidden: 12, lr: 0.02}}
data:
  class_path: outside_models.WaveData
  init_args: {{features: 6, batch_size: 4}}
""",
    "hydra": """model:
  _target_: outside_models.Wave
  features: 6
  hidden: 12
  lr: 0.02
data: {{_target_: outside_models.WaveData, features: 6, batch_size: 4}}
""",
}


def write_package(root: Path) -> Path:
    """The package under ``root`` (put ``root`` on PYTHONPATH); returns ``root``."""
    (root / PACKAGE).mkdir(parents=True)
    (root / PACKAGE / "__init__.py").write_text(_SOURCE)
    return root


def write_recipe(path: Path, form: str, max_steps: int, replicas: int = 2) -> Path:
    """A recipe outside the repository naming the outside classes in ``form``; the trainer, ft and launch come from
    the shipped config groups."""
    path.write_text(f"""defaults:
  - trainer: cpu
  - ft: loopback
  - launch: local
{FORMS[form].format()}trainer: {{max_steps: {max_steps}}}
launch: {{replicas: {replicas}, shard_count: 1}}
""")
    return path


def env_with(root: Path, src: Path) -> dict[str, str]:
    """This process's environment with ``src`` (this repository's sources) and ``root`` on PYTHONPATH."""
    paths = [str(src), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
