"""Config groups (configs/GROUP/OPTION.yaml): composition by defaults lists, choices and overrides on the command
line, --print-config, and errors that list what exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_fthsdp.cli import main
from lightning_fthsdp.recipes import RecipeError, load_recipe, to_yaml
from lightning_fthsdp.recipes.groups import GROUPS, PACKAGED
from tests.paths import ROOT

RECIPES = ROOT / "recipes"
CONFIGS = ROOT / "configs"
# each shipped recipe as it resolved before it composed config groups; llama_gpu since with ft=datacenter's
# heartbeat of issue 16 (5 s interval, 15 s timeout: a leader per group heartbeats, at 100,000 GPUs); the model and
# data since issue 29 in LightningCLI's form (class_path, init_args), with the same values
RESOLVED = Path(__file__).parent / "resolved"
REGRESSOR = "lightning_fthsdp.models.mlp.Regressor"


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp", "llama_gpu", "base"])
def test_shipped_recipes_resolve_exactly_as_before_config_groups(name: str) -> None:
    assert to_yaml(load_recipe(RECIPES / f"{name}.yaml")) == (RESOLVED / f"{name}.yaml").read_text()


def test_the_package_ships_the_top_level_configs() -> None:
    assert PACKAGED.resolve() == CONFIGS.resolve()
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted(GROUPS)


@pytest.mark.parametrize("option", sorted(CONFIGS.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}={p.stem}")
def test_every_option_is_a_valid_fragment_with_a_comment_per_key(option: Path, tmp_path: Path) -> None:
    group = option.parent.name
    recipe = tmp_path / "only.yaml"
    recipe.write_text(f"defaults:\n  - {group}: {option.stem}\n")
    resolved = load_recipe(recipe)
    fragment = OmegaConf.to_container(OmegaConf.load(option), resolve=True)  # alone: interpolations' defaults
    assert set(fragment) <= set(GROUPS[group])
    for section, values in fragment.items():  # each value it sets is the value the recipe resolves to
        _assert_subset(values, getattr(resolved, section), section)
    for line in option.read_text().splitlines():
        if re.match(r"\s*[a-z_]+:\s*\S", line) and not line.lstrip().startswith("#"):
            assert "#" in line, f"{option}: a key without a comment: {line.strip()}"


def _assert_subset(expected: object, actual: object, key: str) -> None:
    if isinstance(expected, dict):
        for name, value in expected.items():
            _assert_subset(value, actual[name] if isinstance(actual, dict) else getattr(actual, name),
                           f"{key}.{name}")
    else:
        assert actual == expected, f"{key}: {actual!r} != {expected!r}"


def test_a_choice_replaces_the_option_where_the_tree_names_it_and_the_recipe_keys_still_win() -> None:
    recipe = load_recipe(RECIPES / "tiny_gpt.yaml", ["model=mlp", "trainer=gpu", "trainer.max_steps=50"])
    assert (recipe.model["class_path"], recipe.model["init_args"]["width"]) == (REGRESSOR, 16)
    assert (recipe.trainer.accelerator, recipe.trainer.precision) == ("gpu", "bf16-mixed")  # base's entry, replaced
    assert recipe.trainer.max_steps == 50  # key overrides come last whatever their place in the list
    assert (recipe.ft.min_replicas, recipe.launch.replicas) == (2, 3)  # the recipe's own keys
    swapped = load_recipe(RECIPES / "tiny_gpt.yaml", ["ft=datacenter"])
    assert swapped.ft.timeouts.heartbeat_timeout_ms == 15000
    assert swapped.ft.checkpoint_dir == ""  # loopback's checkpoints went with it: replaced, not layered


def test_a_group_the_recipe_never_names_is_appended_with_plus_under_its_own_keys(tmp_path: Path) -> None:
    (tmp_path / "own.yaml").write_text("defaults:\n  - model: tiny_gpt\ndata:\n  init_args: {context: 32}\n")
    recipe = load_recipe(tmp_path / "own.yaml", ["+data=stdlib_64mb"])
    data, model = recipe.data["init_args"], recipe.model["init_args"]
    assert (data["corpus_mb"], data["context"], model["context"]) == (64.0, 32, 32)  # the model follows its data
    with pytest.raises(RecipeError, match=r"override 'data=stdlib_64mb': could not override data: the defaults list "
                                          r"names no data \(its groups: model\); to append it: \+data=stdlib_64mb"):
        load_recipe(tmp_path / "own.yaml", ["data=stdlib_64mb"])  # Hydra's refusal: a typo must not add a group


@pytest.mark.parametrize(("data", "expected"), [
    ("{_target_: my.Text, context: 128, features: 3}", (128, 3)),  # Hydra's form: the arguments beside _target_
    ("{class_path: my.Text, init_args: {context: 32, features: 5}}", (32, 5)),  # LightningCLI's form
    ("{_target_: my.Text}", (64, 8)),  # a data module that says neither: the option's own default
])
def test_the_shipped_models_follow_the_datas_sequence_length_and_features_in_either_form(
        tmp_path: Path, data: str, expected: tuple[int, int]) -> None:
    (tmp_path / "gpt.yaml").write_text(f"defaults:\n  - model: tiny_gpt\ndata: {data}\n")
    (tmp_path / "mlp.yaml").write_text(f"defaults:\n  - model: mlp\ndata: {data}\n")
    assert (load_recipe(tmp_path / "gpt.yaml").model["init_args"]["context"],
            load_recipe(tmp_path / "mlp.yaml").model["init_args"]["features"]) == expected


def test_plain_recipe_names_and_group_entries_mix_in_one_defaults_list(tmp_path: Path) -> None:
    (tmp_path / "shared.yaml").write_text("defaults:\n  - trainer: gpu\ntrainer: {seed: 5}\n")
    (tmp_path / "top.yaml").write_text("defaults: [shared, {model: mlp}]\n")
    recipe = load_recipe(tmp_path / "top.yaml")
    assert (recipe.trainer.accelerator, recipe.trainer.seed, recipe.model["class_path"]) == ("gpu", 5, REGRESSOR)


def test_a_recipe_outside_the_clone_finds_the_shipped_options_and_its_own_first(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "mine.yaml").write_text("defaults:\n  - model: tiny_gpt\n  - ft: loopback\n")
    assert load_recipe(recipes / "mine.yaml").model["init_args"]["d_model"] == 96  # shipped inside the package
    own = tmp_path / "configs" / "model"
    own.mkdir(parents=True)
    (own / "tiny_gpt.yaml").write_text("model: {_target_: my.Gpt, d_model: 128}\n")
    (own / "wide.yaml").write_text("model: {class_path: my.Gpt, init_args: {d_model: 256}}\n")
    assert load_recipe(recipes / "mine.yaml").model["d_model"] == 128  # the project's own configs/ comes first
    assert load_recipe(recipes / "mine.yaml", ["model=wide"]).model["init_args"]["d_model"] == 256
    with pytest.raises(RecipeError, match=r"options: llama_85m, mlp, tiny_gpt, wide \(searched .*configs/model"):
        load_recipe(recipes / "mine.yaml", ["model=huge"])


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model=gpt2"], r"override 'model=gpt2': config group 'model' has no option 'gpt2'; "
                     r"options: llama_85m, mlp, tiny_gpt"),
    (["modle=mlp"], r"'modle' is neither a config group nor a key; groups: data, ft, launch, model, trainer; "
                    r"keys: model, data, trainer, ft, launch"),
    (["trainer.max_step=3"], r"unknown key 'trainer.max_step'; allowed keys here: accelerator, precision, max_steps"),
    (["model=mlp", "model=tiny_gpt"], r"'model=tiny_gpt' contradicts model=mlp given before"),
    (["max_steps"], r"neither group=option \(e\.g\. model=mlp\) nor key=value"),
])
def test_bad_choices_and_keys_list_what_exists(overrides: list[str], expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        load_recipe(RECIPES / "tiny_gpt.yaml", overrides)


def test_bad_defaults_and_options_are_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "typo.yaml").write_text("defaults:\n  - modle: mlp\n")
    with pytest.raises(RecipeError, match=r"typo\.yaml: unknown config group 'modle'; groups: data, ft, launch"):
        load_recipe(tmp_path / "typo.yaml")
    (tmp_path / "two.yaml").write_text("defaults:\n  - {model: mlp, data: generated}\n")
    with pytest.raises(RecipeError, match=r"a defaults entry is a recipe name \(base\) or one group: option"):
        load_recipe(tmp_path / "two.yaml")
    model = tmp_path / "configs" / "model"
    model.mkdir(parents=True)
    (model / "greedy.yaml").write_text("model: {_target_: my.Gpt}\ntrainer: {max_steps: 3}\n")
    (model / "misspelt.yaml").write_text("model: {class_path: my.Gpt, n_layr: 3}\n")
    (tmp_path / "r.yaml").write_text("defaults:\n  - model: greedy\n")
    # Keys beyond the group's own sections go under the group's name (Hydra's default package): not a model.
    with pytest.raises(RecipeError, match=r"model names no class \(keys model, trainer\)"):
        load_recipe(tmp_path / "r.yaml")
    with pytest.raises(RecipeError, match=r"model\.n_layr is not a key of LightningCLI's form: allowed keys "
                                          r"class_path, init_args"):
        load_recipe(tmp_path / "r.yaml", ["model=misspelt"])


def test_launch_print_config_prints_the_composed_recipe_and_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["launch", str(RECIPES / "tiny_gpt.yaml"), "model=mlp", "--print-config", "--replicas", "2",
                 "trainer.max_steps=5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    expected = load_recipe(RECIPES / "tiny_gpt.yaml", ["model=mlp", "trainer.max_steps=5", "launch.replicas=2"])
    assert load_recipe(tmp_path / "printed.yaml") == expected
    assert not out.exists()


def test_fit_print_config_prints_the_composed_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(RECIPES / "mlp.yaml"), "data=generated", "model.init_args.width=5",
                 "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["width"] == 5


def test_launch_refuses_an_unknown_option_listing_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"fthsdp launch: error: .*has no option 'big'; options: generated, "
                                         r"stdlib_2mb, stdlib_64mb"):
        main(["launch", str(RECIPES / "mlp.yaml"), "data=big", "--print-config"])
