"""``fthsdp fit``: one replica group's training process, LightningCLI driven by a recipe.

``fthsdp fit --config RECIPE.yaml [--record PATH] [key=value ...] [--trainer.x=y ...]``: the recipe (with its
overrides) is validated and turned into a LightningCLI config (model, data, Trainer with ``FTHSDPStrategy``);
any remaining ``--...`` arguments go to LightningCLI unchanged and win over the recipe (``-- --print_config``
prints the result). fthsdp's own options come first. The group's identity and the lighthouse come from the
environment (``FTHSDP_REPLICA_ID``, ``FTHSDP_LIGHTHOUSE``, ``FTHSDP_REPLICAS``, ``FTHSDP_REPLICA_INDEX``,
see docs/lightning.md); ``fthsdp launch`` sets them for each group it starts.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fthsdp.recipes.schema import RecipeConfig

STRATEGY = "lightning_fthsdp.FTHSDPStrategy"
RECORDER = "lightning_fthsdp.launch.recorder.LaunchRecorder"
_TASKS = {  # task -> (LightningModule, LightningDataModule, model fields, data fields) of its recipe section
    "lm": ("lightning_fthsdp.models.gpt.DecoderLM", "lightning_fthsdp.models.text.StdlibTextData",
           ("style", "n_layer", "n_head", "d_model", "context", "lr", "weight_decay", "warmup_steps"),
           ("context", "corpus_mb", "batch_size", "val_windows")),
    "regression": ("lightning_fthsdp.models.mlp.Regressor", "lightning_fthsdp.models.mlp.RegressionData",
                   ("features", "width", "blocks", "lr"), ("samples", "features", "batch_size", "val_samples")),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "fit", help="train one replica group from a recipe (LightningCLI with strategy fthsdp)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, metavar="RECIPE.yaml",
                        help="an omegaconf recipe (recipes/*.yaml), validated against lightning_fthsdp.recipes")
    parser.add_argument("--record", type=Path, default=None, metavar="PATH",
                        help="append one JSON line per committed step to PATH (what fthsdp launch reads)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="key=value | --lightning.arg",
                        help="recipe overrides (key=value), then LightningCLI arguments (--trainer.x=y)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.recipes.loader import RecipeError, load_recipe

    overrides, lightning_args = split_rest(args.rest)
    try:
        recipe = load_recipe(args.config, overrides)
    except RecipeError as err:
        raise SystemExit(f"fthsdp fit: error: {err}") from None
    main(recipe, lightning_args, record=args.record)
    return 0


def split_rest(rest: Sequence[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, LightningCLI arguments): a bare ``key=value`` is an override unless it is the value of
    the option before it (``--trainer.max_steps 5``); ``--`` is only a separator."""
    overrides, lightning_args = [], []
    for i, token in enumerate(rest):
        if token == "--":
            continue
        after_option = i > 0 and rest[i - 1].startswith("-") and "=" not in rest[i - 1] and rest[i - 1] != "--"
        if not token.startswith("-") and "=" in token and not after_option:
            overrides.append(token)
        else:
            lightning_args.append(token)
    return overrides, lightning_args


def lightning_config(recipe: RecipeConfig, record: Path | None = None) -> dict[str, Any]:
    """The LightningCLI ``fit`` config of ``recipe`` (class paths and init args)."""
    model_path, data_path, model_fields, data_fields = _TASKS[recipe.task]
    section = getattr(recipe, recipe.task)
    trainer = recipe.trainer
    callbacks = []
    if record is not None or trainer.min_step_time_s:
        callbacks.append({"class_path": RECORDER, "init_args": {
            "jsonl": str(record) if record is not None else None, "min_step_time_s": trainer.min_step_time_s}})
    timeouts = {name: getattr(recipe.ft.timeouts, name) for name in recipe.ft.timeouts.__dataclass_fields__}
    return {
        "seed_everything": trainer.seed,
        "trainer": {
            "accelerator": trainer.accelerator, "devices": recipe.launch.shard_count, "num_nodes": 1,
            "precision": trainer.precision, "max_steps": trainer.max_steps,
            "gradient_clip_val": trainer.gradient_clip_val, "log_every_n_steps": trainer.log_every_n_steps,
            "strategy": {"class_path": STRATEGY,
                         "init_args": {"lr_scaling": recipe.ft.lr_scaling,
                                       "keep_global_batch": recipe.ft.keep_global_batch, "timeouts": timeouts,
                                       "validate_every_n_steps": trainer.val_every_n_steps}},
            "callbacks": callbacks,
        },
        "model": {"class_path": model_path, "init_args": {f: getattr(section, f) for f in model_fields}},
        "data": {"class_path": data_path, "init_args": {f: getattr(section, f) for f in data_fields}},
    }


def main(recipe: RecipeConfig, lightning_args: Sequence[str] = (), record: Path | None = None) -> None:
    """Run LightningCLI ``fit`` on ``recipe``; ``lightning_args`` win over it."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from lightning_fthsdp.lightning import release_process_groups  # also registers strategy="fthsdp"

    config = json.dumps(lightning_config(recipe, record))  # JSON is YAML: jsonargparse reads it as a config string
    # We pass the translated recipe as args but must leave sys.argv alone: Lightning's launcher re-executes it to
    # start the group's other ranks. LightningCLI warns about exactly that combination.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_callback=None, args=["fit", "--config", config, *lightning_args])
    release_process_groups()
