"""``fthsdp fit``: one replica group's training process, LightningCLI driven by a recipe.

``fthsdp fit --config RECIPE.yaml [--record PATH] [group=option | key=value ...] [--trainer.x=y ...]``: the recipe
(with its config group choices and overrides, docs/recipes.md) is validated and turned into a LightningCLI config
(model, data, Trainer with ``FTHSDPStrategy``); any remaining ``--...`` arguments go to LightningCLI unchanged and win
over the recipe (``-- --print_config`` prints the result; ``--print-config`` prints the composed recipe instead).
fthsdp's own options come first. The group's identity and the lighthouse come from the environment
(``FTHSDP_REPLICA_ID``, ``FTHSDP_LIGHTHOUSE``, ``FTHSDP_REPLICAS``, ``FTHSDP_REPLICA_INDEX``, see
docs/lightning.md); ``fthsdp launch`` sets them for each group it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the recipes need omegaconf (extra "launch"): importing them here would break `fthsdp --help`
    from lightning_fthsdp.recipes.schema import RecipeConfig

STRATEGY = "lightning_fthsdp.FTHSDPStrategy"
ENV_STANDBY = "FTHSDP_STANDBY"
"""A path: import everything, create ``PATH.ready`` (rank 0), then wait until ``PATH`` exists before training (how
``fthsdp launch`` keeps a group's next incarnation ready, see ``launch.standby``); unset: train at once."""
_LAUNCH_OPTIONS = ("--trainer.devices", "--trainer.num_nodes", "--trainer.strategy", "--trainer.accelerator",
                   "--print_config")  # a group started with any of these is left to Lightning's own launcher
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
    parser.add_argument("--no-ft", action="store_true",
                        help="train this group alone with Lightning's own strategy (ddp over --shard-count ranks), "
                             "no lighthouse: the floor that bench/bench_restart.py compares a restart with")
    parser.add_argument("--print-config", action="store_true",
                        help="print the composed, validated recipe (YAML, every field) and exit without training")
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="group=option | key=value | --lightning.arg",
                        help="config group choices (model=mlp) and recipe overrides (key=value), then LightningCLI "
                             "arguments (--trainer.x=y)")
    parser.set_defaults(func=run, extras=("launch", "lightning"))


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.recipes.loader import RecipeError, load_recipe, to_yaml

    overrides, lightning_args = split_rest(args.rest)
    try:
        recipe = load_recipe(args.config, overrides)
    except RecipeError as err:
        raise SystemExit(f"fthsdp fit: error: {err}") from None
    if args.print_config or "--print-config" in lightning_args:  # also after the overrides, where it is natural
        print(to_yaml(recipe), end="")
        return 0
    if _may_start_ranks_early(recipe.launch.shard_count, lightning_args):
        _watch(_start_other_ranks(recipe.launch.shard_count))
    if os.environ.get(ENV_STANDBY):
        _stand_by(Path(os.environ[ENV_STANDBY]), recipe)
    main(recipe, lightning_args, record=args.record, ft=not args.no_ft)
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


def lightning_config(recipe: RecipeConfig, record: Path | None = None, ft: bool = True) -> dict[str, Any]:
    """The LightningCLI ``fit`` config of ``recipe`` (class paths and init args); ``ft=False``: Lightning's own
    strategy instead of ``FTHSDPStrategy`` (``auto`` on one device, ``ddp`` over several)."""
    model_path, data_path, model_fields, data_fields = _TASKS[recipe.task]
    section = getattr(recipe, recipe.task)
    trainer = recipe.trainer
    callbacks = []
    if record is not None or trainer.min_step_time_s:
        callbacks.append({"class_path": RECORDER, "init_args": {
            "jsonl": str(record) if record is not None else None, "min_step_time_s": trainer.min_step_time_s}})
    timeouts = {name: getattr(recipe.ft.timeouts, name) for name in recipe.ft.timeouts.__dataclass_fields__}
    strategy: str | dict[str, Any] = {
        "class_path": STRATEGY, "init_args": {"lr_scaling": recipe.ft.lr_scaling,
                                              "keep_global_batch": recipe.ft.keep_global_batch, "timeouts": timeouts,
                                              "validate_every_n_steps": trainer.val_every_n_steps,
                                              **_checkpoint_args(recipe), **_address_args(recipe)}}
    if not ft:
        strategy = "ddp" if recipe.launch.shard_count > 1 else "auto"
    return {
        "seed_everything": trainer.seed,
        "trainer": {
            "accelerator": trainer.accelerator, "devices": recipe.launch.shard_count, "num_nodes": 1,
            "precision": trainer.precision, "max_steps": trainer.max_steps,
            "gradient_clip_val": trainer.gradient_clip_val, "log_every_n_steps": trainer.log_every_n_steps,
            "strategy": strategy,
            "callbacks": callbacks,
        },
        "model": {"class_path": model_path, "init_args": {f: getattr(section, f) for f in model_fields}},
        "data": {"class_path": data_path, "init_args": {f: getattr(section, f) for f in data_fields}},
    }


def _checkpoint_args(recipe: RecipeConfig) -> dict[str, Any]:
    """The strategy's durable-checkpoint arguments (none when the recipe writes no checkpoints)."""
    ft = recipe.ft
    if not ft.checkpoint_dir:
        return {}
    return {"checkpoint_dir": ft.checkpoint_dir, "checkpoint_every_n_steps": ft.checkpoint_every_n_steps,
            "checkpoint_keep": ft.checkpoint_keep}


def _address_args(recipe: RecipeConfig) -> dict[str, Any]:
    """The strategy's ``advertise_host`` when the recipe sets one; else none, so $FTHSDP_ADVERTISE_HOST still applies
    (an explicit argument would win over it)."""
    return {"advertise_host": recipe.ft.advertise_host} if recipe.ft.advertise_host else {}


def main(recipe: RecipeConfig, lightning_args: Sequence[str] = (), record: Path | None = None,
         ft: bool = True) -> None:
    """Run LightningCLI ``fit`` on ``recipe``; ``lightning_args`` win over it; ``ft=False``: without fault
    tolerance (see ``lightning_config``)."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from lightning_fthsdp.config import anatomy
    from lightning_fthsdp.lightning import release_process_groups  # also registers strategy="fthsdp"

    anatomy.mark("imports")

    config = json.dumps(lightning_config(recipe, record, ft))  # JSON is YAML: jsonargparse reads it as a config string
    # We pass the translated recipe as args but must leave sys.argv alone: Lightning's launcher re-executes it to
    # start the group's other ranks. LightningCLI warns about exactly that combination.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_callback=None, args=["fit", "--config", config, *lightning_args])
    release_process_groups()


def _may_start_ranks_early(shard_count: int, lightning_args: Sequence[str]) -> bool:
    """Whether this process starts the group's other ranks itself (see ``_start_other_ranks``): it is rank 0 of a
    group of several ranks that nobody else launches, and no argument changes the devices from the recipe's."""
    return (shard_count > 1 and "LOCAL_RANK" not in os.environ
            and not any(a.startswith(_LAUNCH_OPTIONS) for a in lightning_args))


def _start_other_ranks(shard_count: int) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1.. of this group now, before any heavy import, with the environment of an external launch
    (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), which Lightning then respects instead of starting them
    itself once rank 0 has imported everything and built the Trainer. Their imports overlap ours: a group of ``n``
    ranks starts in the time of one rank's start-up, not two (on a restart, the largest phase after the imports)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.update(NODE_RANK="0", LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(shard_count))
    main_module = getattr(sys.modules["__main__"], "__spec__", None)
    command = ([sys.executable, "-m", main_module.name, *sys.argv[1:]] if main_module is not None
               else [sys.executable, *sys.argv])
    return [subprocess.Popen(command, env=dict(os.environ, LOCAL_RANK=str(rank), RANK=str(rank)))
            for rank in range(1, shard_count)]


def _watch(ranks: list[subprocess.Popen[bytes]]) -> None:
    """If one of the ranks this process started fails, end them all and this process with exit code 1 (as
    Lightning's launcher does), so the group dies whole and its launcher restarts it instead of this rank waiting
    on a collective for its timeout."""

    def watch() -> None:
        while True:
            for proc in ranks:
                code = proc.poll()
                if code is not None and code != 0:
                    for other in ranks:
                        if other.poll() is None:
                            other.kill()
                    print(f"fthsdp fit: rank process {proc.pid} exited with {code}: ending this group",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            if all(proc.poll() == 0 for proc in ranks):
                return
            threading.Event().wait(0.5)

    threading.Thread(target=watch, name="fthsdp-rank-watch", daemon=True).start()


def _stand_by(go: Path, recipe: RecipeConfig) -> None:
    """Do the imports a fit needs (Lightning, ours, the recipe's model and data modules), say so, and wait for
    ``go`` (polling: the launcher creates it when this group's running incarnation has died)."""
    import importlib
    import time

    import lightning.pytorch  # noqa: F401
    from lightning.pytorch.cli import LightningCLI  # noqa: F401

    from lightning_fthsdp.config import anatomy
    from lightning_fthsdp.launch import recorder  # noqa: F401

    for class_path in _TASKS[recipe.task][:2]:
        importlib.import_module(class_path.rsplit(".", 1)[0])
    anatomy.mark("imports")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        go.with_name(go.name + ".ready").touch()
    parent = os.getppid()
    while not go.exists():
        if os.getppid() != parent:  # the launcher (or rank 0) is gone: nobody will ever say go
            raise SystemExit("fthsdp fit: standby ended: the process that started it exited")
        time.sleep(0.02)
    anatomy.mark("released", go.stat().st_mtime)  # when the launcher said go (maybe before our imports ended)
