"""``fit`` any LightningModule (and optional LightningDataModule) by class path, as one replica group.

    python tests/lightning/fit_module.py fit --model=shapes.TiedWeights --trainer.strategy=fthsdp ...
    python tests/lightning/fit_module.py fit --model=lightning.pytorch.demos.boring_classes.BoringModel ...

With examples/train_lightning.py's ``--recorder.*`` options (JSONL per committed step, final parameters).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "examples")]

import lightning_fthsdp  # noqa: E402,F401  (registers strategy="fthsdp")
from lightning_fthsdp.lightning import release_process_groups  # noqa: E402
from train_lightning import StepRecorder  # noqa: E402


class AnyModuleCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(StepRecorder, "recorder")


def main() -> None:
    AnyModuleCLI(seed_everything_default=0, save_config_callback=None, subclass_mode_model=True,
                 subclass_mode_data=True)
    release_process_groups()


if __name__ == "__main__":
    main()
