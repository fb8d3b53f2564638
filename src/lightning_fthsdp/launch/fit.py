"""``fthsdp fit``: one replica group's training process, LightningCLI driven by a recipe.

``fthsdp fit [--recipe RECIPE.yaml] [-c CONFIG.yaml ...] [group=option | key=value ...] [--trainer.x=y ...]``, in any
order, as LightningCLI's ``fit`` reads: ``--trainer.max_steps=5`` (or ``--trainer.max_steps 5``), ``-c/--config``
(repeatable), ``--print_config``, ``--model.help CLASS`` and ``--help`` go to LightningCLI and win over the recipe. A
``--config`` file is the recipe when it looks like one (a ``defaults`` list, an ``ft`` or ``launch`` section: see
``sort_configs``), so ``fthsdp fit --config R.yaml --trainer.max_steps=5`` works; ``--recipe`` names it explicitly.
The recipe (with its config group choices and Hydra-style overrides, docs/recipes.md) is validated and turned into a
LightningCLI config (model, data, Trainer with ``FTHSDPStrategy``); ``--print-config`` prints the composed recipe,
before LightningCLI's configs and arguments apply over it (``--print_config`` shows the result). The model may come
from LightningCLI instead (a ``-c`` config's ``model:``, ``--model=pkg.Module``): then the recipe needs none. The
group's identity and the lighthouse come from the environment (``FTHSDP_REPLICA_ID``, ``FTHSDP_LIGHTHOUSE``,
``FTHSDP_REPLICAS``, ``FTHSDP_REPLICA_INDEX``, see docs/lightning.md); ``fthsdp launch`` sets them for each group it
starts.
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

from lightning_fthsdp.config.env import ENV_STANDBY

if TYPE_CHECKING:  # the recipes need omegaconf (extra "launch"): importing them here would break `fthsdp --help`
    from lightning_fthsdp.recipes.schema import RecipeConfig

STRATEGY = "lightning_fthsdp.FTHSDPStrategy"
_LAUNCH_OPTIONS = ("--trainer.devices", "--trainer.num_nodes", "--trainer.strategy", "--trainer.accelerator",
                   "--print_config", "--config")  # a group started with any of these (a LightningCLI config may set
# the devices) is left to Lightning's own launcher
RECORDER = "lightning_fthsdp.lightning.launch_records.LaunchRecorder"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # fit reads its whole command line itself (``parse``): LightningCLI's own arguments (--trainer.x=y, -c, --help)
    # mix freely with fthsdp's and the recipe's overrides, so nothing may be taken by this parser's prefix rules.
    parser = subparsers.add_parser(
        "fit", help="train one replica group from a recipe (LightningCLI with strategy fthsdp)", add_help=False,
        prefix_chars="\0", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    parser.set_defaults(func=run, extras=("launch", "lightning"))


def options() -> argparse.ArgumentParser:
    """fthsdp's own options of ``fit``; every other argument is an override or LightningCLI's (``parse``)."""
    parser = argparse.ArgumentParser(
        prog="fthsdp fit", add_help=False, allow_abbrev=False, description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="fthsdp fit [--recipe RECIPE.yaml] [-c CONFIG.yaml ...] [--record PATH] [--no-ft] [--print-config] "
              "[group=option | key=value ...] [--trainer.x=y ... | --print_config | --model.help CLASS]")
    parser.add_argument("-h", "--help", action="store_true",
                        help="this help, then LightningCLI's for fit (--trainer.*, --model.*, --data.*)")
    parser.add_argument("--recipe", type=Path, default=None, metavar="RECIPE.yaml",
                        help="the recipe (recipes/*.yaml or a shipped one's name); without one, the schema's defaults")
    parser.add_argument("-c", "--config", type=Path, action="append", default=[], metavar="CONFIG.yaml",
                        help="a recipe or a LightningCLI config, told apart by their keys (a recipe has defaults: or "
                             "an ft:/launch: section, a LightningCLI config seed_everything:, ckpt_path: or Trainer "
                             "arguments recipes lack; see docs/recipes.md); LightningCLI configs apply in order over "
                             "the recipe")
    parser.add_argument("--record", type=Path, default=None, metavar="PATH",
                        help="append one JSON line per committed step to PATH (what fthsdp launch reads)")
    parser.add_argument("--no-ft", action="store_true",
                        help="train this group alone with Lightning's own strategy (ddp over --shard-count ranks), "
                             "no lighthouse: the floor that bench/bench_restart.py compares a restart with")
    parser.add_argument("--print-config", action="store_true",
                        help="print the composed, validated recipe (YAML, every field) and exit without training; "
                             "LightningCLI's -c configs and --trainer.*/--model.*/--data.* arguments apply over it "
                             "when training and are not in it: --print_config prints LightningCLI's resulting config")
    return parser


def run(args: argparse.Namespace) -> int:
    own, overrides, lightning_args = parse(args.argv)
    if own.help or any(a.partition("=")[0].endswith(".help") for a in lightning_args):  # --model.help CLASS
        return _help(["--help"] if own.help else lightning_args, ours=own.help)
    from lightning_fthsdp.recipes import components
    from lightning_fthsdp.recipes.loader import RecipeError, load_recipe, to_yaml

    try:
        recipe_file, lightning_configs = sort_configs(own.recipe, own.config)
        recipe = load_recipe(recipe_file, overrides)
        if own.print_config or "--print-config" in lightning_args:  # also after the overrides, where natural
            print(to_yaml(recipe), end="")
            _note_what_applies_over(lightning_configs, [a for a in lightning_args if a != "--print-config"])
            return 0
        model_elsewhere = lightning_may_name_model(lightning_configs, lightning_args)
        if not model_elsewhere:
            components.require("model", recipe.model)
    except (RecipeError, ValueError) as err:
        raise SystemExit(f"fthsdp fit: error: {err}") from None
    lightning_args = [*(f"--config={c}" for c in lightning_configs), *lightning_args]
    if _may_start_ranks_early(recipe.launch.shard_count, lightning_args):
        _watch(_start_other_ranks(recipe.launch.shard_count))
    if os.environ.get(ENV_STANDBY):
        _stand_by(Path(os.environ[ENV_STANDBY]), recipe)
    main(recipe, lightning_args, record=own.record, ft=not own.no_ft, model_elsewhere=model_elsewhere)
    return 0


def _note_what_applies_over(lightning_configs: Sequence[Path], lightning_args: Sequence[str]) -> None:
    """Say on stderr (stdout is the recipe, loadable as one) that the printed recipe is not all the run uses."""
    applied = [*(f"-c {c}" for c in lightning_configs), *lightning_args]
    if applied:
        print(f"fthsdp fit: --print-config printed the recipe alone; training applies {' '.join(applied)} over "
              "it: --print_config prints LightningCLI's resulting config", file=sys.stderr)


def lightning_may_name_model(lightning_configs: Sequence[Path], lightning_args: Sequence[str]) -> bool:
    """Whether LightningCLI may get the model from its own input (a config with ``model:``, ``--model=...``, a
    ``--config`` after ``--``): then the recipe need not name one, and LightningCLI reports a missing or wrong one."""
    return (any("model" in read_config(c) for c in lightning_configs)
            or any(a.startswith("--model") or a.partition("=")[0] in ("-c", "--config") for a in lightning_args))


def _help(lightning_args: Sequence[str], ours: bool) -> int:
    """fthsdp's options (``ours``), then LightningCLI's own help of ``fit`` for ``lightning_args`` (``--help``: what
    ``--trainer.*``, ``--model.*`` accept; ``--model.help CLASS``: a module's arguments). No recipe is needed."""
    if ours:
        options().print_help()
        print("\nLightningCLI's arguments of fit (they win over the recipe; --model.help CLASS lists a module's):\n",
              flush=True)
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.cli import LightningCLI
    except ModuleNotFoundError as err:
        if not ours:
            raise
        from lightning_fthsdp.config import extras

        print(extras.install_hint("fthsdp fit", ("launch", "lightning"), [err.name or ""]))
        return 0

    import lightning_fthsdp.lightning  # noqa: F401 -- registers strategy="fthsdp"

    LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_callback=None, args=["fit", *lightning_args])  # exits 0 once printed
    return 0


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(fthsdp's options, recipe overrides, LightningCLI arguments) of ``fthsdp fit``'s command line, in any order."""
    own, rest = options().parse_known_args(list(argv))
    return (own, *split_rest(rest))


def split_rest(rest: Sequence[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, LightningCLI arguments): a bare ``key=value`` (or ``+key=value``, ``~key``: Hydra's
    grammar, docs/recipes.md) is an override unless it is the value of the option before it
    (``--trainer.max_steps 5``); ``--`` is only a separator."""
    overrides, lightning_args = [], []
    for i, token in enumerate(rest):
        if token == "--":
            continue
        after_option = i > 0 and rest[i - 1].startswith("-") and "=" not in rest[i - 1] and rest[i - 1] != "--"
        override = not token.startswith("-") and ("=" in token or token.startswith("~"))
        if override and not after_option:
            overrides.append(token)
        else:
            lightning_args.append(token)
    return overrides, lightning_args


#: The recipe's ``trainer`` keys that Lightning's Trainer has not (a test keeps this in step with both), so telling the
#: two apart imports no Lightning.
RECIPE_ONLY_TRAINER_KEYS = frozenset({"val_every_n_steps", "seed", "min_step_time_s"})


def sort_configs(recipe: Path | None, configs: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """(the recipe, the LightningCLI configs in order) among ``--recipe`` and the ``-c/--config`` files: a file is a
    recipe when it has a ``defaults`` list or a section only recipes have (``ft``, ``launch``, or a ``trainer`` key
    the recipe's schema has and Lightning's Trainer does not), a LightningCLI config when it has a key only those have
    (``seed_everything``, ``ckpt_path``, a Trainer argument the recipe lacks); one with neither (only ``trainer``,
    ``model``, ``data``, meaning the same in both) is the recipe where no other is given. A file with both kinds of
    key, or two recipes, is refused naming the keys. Each path is resolved once (a shipped recipe's name is said
    once), and returned resolved."""
    from lightning_fthsdp.launch.catalog import RECIPES

    recipes = [RECIPES.find(recipe, "--recipe")] if recipe is not None else []
    kinds = [(path, config_kind(path)) for path in (RECIPES.find(config, "-c/--config") for config in configs)]
    recipes += [path for path, kind in kinds if kind == "recipe"]
    either = [path for path, kind in kinds if kind == "either"]
    if not recipes and either:  # only trainer/model/data, which mean the same in both: the recipe, validated
        recipes.append(either[0])
    lightning = [path for path, _ in kinds if path not in recipes]
    if len(recipes) > 1:
        raise ValueError(f"{' and '.join(map(str, recipes))} are both recipes: give one (compose the other with "
                         "its defaults list)")
    return (recipes[0] if recipes else None), lightning


def read_config(path: Path) -> dict[str, Any]:
    """The mapping in the ``-c/--config`` file at ``path`` (an existing file); ValueError naming it otherwise."""
    import yaml

    try:
        content = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"-c/--config {path}: {err}") from None
    if not isinstance(content, dict):
        raise ValueError(f"-c/--config {path} must be a mapping (a recipe or a LightningCLI config), got "
                         f"{type(content).__name__}")
    return content


def config_kind(path: Path) -> str:
    """"recipe", "lightning" or "either" (see ``sort_configs``) of the file at ``path``; ValueError for a file mixing
    both kinds of key."""
    import dataclasses

    from lightning_fthsdp.recipes.schema import RecipeConfig, TrainerConfig

    content = read_config(path)
    sections = {f.name for f in dataclasses.fields(RecipeConfig)}
    shared = {"trainer", "model", "data"}  # the same words in both, and in both the same things
    trainer = content.get("trainer") if isinstance(content.get("trainer"), dict) else {}
    recipe_only = (set(content) & ((sections | {"defaults"}) - shared)) | {
        f"trainer.{k}" for k in set(trainer) & RECIPE_ONLY_TRAINER_KEYS}
    lightning_only = (set(content) - sections - {"defaults"}) | {  # seed_everything, ckpt_path, optimizer, ...
        f"trainer.{k}" for k in set(trainer) - {f.name for f in dataclasses.fields(TrainerConfig)}}
    if recipe_only and lightning_only:
        raise ValueError(f"-c/--config {path} mixes recipe keys ({', '.join(sorted(recipe_only))}) and LightningCLI "
                         f"keys ({', '.join(sorted(lightning_only))}): split it into a recipe (--recipe) and a "
                         "LightningCLI config (-c)")
    return "recipe" if recipe_only else "lightning" if lightning_only else "either"


def lightning_config(recipe: RecipeConfig, record: Path | None = None, ft: bool = True,
                     model_elsewhere: bool = False) -> dict[str, Any]:
    """The LightningCLI ``fit`` config of ``recipe`` (class paths and init args); ``ft=False``: Lightning's own
    strategy instead of ``FTHSDPStrategy`` (``auto`` on one device, ``ddp`` over several); ``model_elsewhere``:
    LightningCLI's own input may name the model (``lightning_may_name_model``), so the recipe need not."""
    from lightning_fthsdp.recipes import components

    if not model_elsewhere:
        components.require("model", recipe.model)
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
        **({"model": components.to_lightning(recipe.model)} if recipe.model is not None else {}),
        **({"data": components.to_lightning(recipe.data)} if recipe.data is not None else {}),
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
         ft: bool = True, model_elsewhere: bool = False) -> None:
    """Run LightningCLI ``fit`` on ``recipe``; ``lightning_args`` win over it; ``ft=False`` and ``model_elsewhere``:
    see ``lightning_config``."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from lightning_fthsdp.config import anatomy
    from lightning_fthsdp.lightning import release_process_groups  # also registers strategy="fthsdp"

    anatomy.mark("imports")

    # JSON is YAML: jsonargparse reads it as a config string
    config = json.dumps(lightning_config(recipe, record, ft, model_elsewhere))
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
    from lightning_fthsdp.lightning import launch_records  # noqa: F401
    from lightning_fthsdp.recipes import components

    for section in (recipe.model, recipe.data):
        if section is not None:
            importlib.import_module(components.to_lightning(section)["class_path"].rsplit(".", 1)[0])
    anatomy.mark("imports")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        go.with_name(go.name + ".ready").touch()
    parent = os.getppid()
    while not go.exists():
        if os.getppid() != parent:  # the launcher (or rank 0) is gone: nobody will ever say go
            raise SystemExit("fthsdp fit: standby ended: the process that started it exited")
        time.sleep(0.02)
    anatomy.mark("released", go.stat().st_mtime)  # when the launcher said go (maybe before our imports ended)
