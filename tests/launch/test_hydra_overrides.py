"""Hydra's override grammar and defaults-list keywords on recipes: +, ++, ~, group@package, _self_, override,
optional, sweeps only with -m, Hydra's precedence of command-line choices, and "not supported" for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.cli import main
from lightning_fthsdp.recipes import RecipeError, load_recipe
from lightning_fthsdp.recipes.overrides import expand
from lightning_fthsdp.recipes.schema import TrainerConfig
from tests.paths import ROOT


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project of its own: recipes/ and configs/ (found before the package's), with two options per group."""
    configs = tmp_path / "configs"
    for group, option, text in [
        ("trainer", "slow", "trainer:\n  max_steps: 40\n  seed: 1\n"),
        ("trainer", "fast", "trainer:\n  max_steps: 8\n"),
        ("ft", "near", "ft:\n  min_replicas: 1\n  checkpoint_dir: ckpt\n  checkpoint_every_n_steps: 5\n"),
        ("ft", "far", "ft:\n  lr_scaling: linear\n"),
        ("model", "net", "model:\n  class_path: pkg.Net\n  init_args: {width: 4}\n"),
        ("model", "hydra_net", "_target_: pkg.HydraNet\ndepth: 3\n"),  # Hydra's style: keys of its package
        ("data", "rows", "# @package data.init_args\nrows: 9\n"),
    ]:
        (configs / group).mkdir(parents=True, exist_ok=True)
        (configs / group / f"{option}.yaml").write_text(text)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "base.yaml").write_text("defaults:\n  - trainer: slow\n  - ft: near\n")
    (recipes / "job.yaml").write_text("defaults:\n  - base\n  - override ft: far\n  - model: net\ntrainer:\n"
                                      "  seed: 7\nft:\n  checkpoint_dir: ckpt\ndata:\n  class_path: pkg.Rows\n")
    return recipes


def test_plus_adds_a_key_the_recipe_lacks_and_refuses_one_it_has(project: Path) -> None:
    recipe = load_recipe(project / "job.yaml", ["+model.init_args.depth=2", "+trainer.gradient_clip_val=1.0"])
    assert recipe.model == {"class_path": "pkg.Net", "init_args": {"width": 4, "depth": 2}}
    assert recipe.trainer.gradient_clip_val == 1.0  # null is no value: Hydra's + adds over it
    with pytest.raises(RecipeError, match=r"override '\+trainer\.max_steps=5': could not append to the recipe: "
                                          r"trainer\.max_steps is already 40; set it with trainer\.max_steps=5, or "
                                          r"add or set it with \+\+trainer\.max_steps=5"):
        load_recipe(project / "job.yaml", ["+trainer.max_steps=5"])
    with pytest.raises(RecipeError, match=r"override 'model\.init_args\.depth=2': could not override "
                                          r"model\.init_args\.depth: the recipe has no such key; to add it: "
                                          r"\+model\.init_args\.depth=2"):
        load_recipe(project / "job.yaml", ["model.init_args.depth=2"])
    with pytest.raises(RecipeError, match=r"'\+trainer\.foo=1': unknown key 'trainer\.foo'; allowed keys here: "
                                          r"accelerator"):
        load_recipe(project / "job.yaml", ["+trainer.foo=1"])


def test_plus_plus_adds_or_sets(project: Path) -> None:
    recipe = load_recipe(project / "job.yaml", ["++trainer.max_steps=5", "++model.init_args.depth=2"])
    assert (recipe.trainer.max_steps, recipe.model["init_args"]) == (5, {"width": 4, "depth": 2})


def test_tilde_removes_what_the_recipe_set_so_the_schema_default_applies(project: Path) -> None:
    recipe = load_recipe(project / "job.yaml", ["~trainer.max_steps", "~model.init_args.width",
                                                "~ft.lr_scaling=linear"])
    assert recipe.trainer.max_steps == TrainerConfig().max_steps
    assert recipe.model == {"class_path": "pkg.Net", "init_args": {}}
    assert recipe.ft.lr_scaling == "none"
    with pytest.raises(RecipeError, match=r"'~trainer\.max_steps=3': could not delete trainer\.max_steps: its value "
                                          r"is 40, not 3"):
        load_recipe(project / "job.yaml", ["~trainer.max_steps=3"])
    with pytest.raises(RecipeError, match=r"'~trainer\.max_step': could not delete trainer\.max_step: the recipe has "
                                          r"no such key"):
        load_recipe(project / "job.yaml", ["~trainer.max_step"])


def test_self_places_the_files_own_keys_in_the_merge_order(project: Path) -> None:
    (project / "own_last.yaml").write_text("defaults:\n  - trainer: slow\ntrainer:\n  max_steps: 3\n")
    (project / "own_first.yaml").write_text("defaults:\n  - _self_\n  - trainer: slow\ntrainer:\n  max_steps: 3\n")
    assert load_recipe(project / "own_last.yaml").trainer.max_steps == 3
    assert load_recipe(project / "own_first.yaml").trainer.max_steps == 40


def test_override_in_a_defaults_list_replaces_the_choice_an_included_recipe_made(project: Path) -> None:
    (project / "swap.yaml").write_text("defaults:\n  - base\n  - override trainer: fast\n")
    recipe = load_recipe(project / "swap.yaml")
    assert (recipe.trainer.max_steps, recipe.trainer.seed) == (8, 0)  # slow's seed went with it: replaced
    assert recipe.ft.checkpoint_dir == "ckpt"
    (project / "nothing.yaml").write_text("defaults:\n  - override trainer: fast\n")
    with pytest.raises(RecipeError, match=r"'override trainer: fast' overrides nothing: no entry before it \(nor a "
                                          r"recipe it includes\) chooses trainer; drop 'override'"):
        load_recipe(project / "nothing.yaml")


def test_optional_and_null_entries_add_nothing(project: Path) -> None:
    (project / "opt.yaml").write_text("defaults:\n  - optional trainer: absent\n  - ft: null\n  - model: net\n")
    recipe = load_recipe(project / "opt.yaml")
    assert (recipe.trainer.max_steps, recipe.ft.lr_scaling) == (TrainerConfig().max_steps, "none")


def test_packages_place_an_options_keys(project: Path) -> None:
    recipe = load_recipe(project / "job.yaml", ["model=hydra_net", "+data=rows"])
    assert recipe.model == {"_target_": "pkg.HydraNet", "depth": 3}  # Hydra's default package: the group's name
    assert recipe.data == {"init_args": {"rows": 9}, "class_path": "pkg.Rows"}  # its file's # @package line
    placed = load_recipe(project / "job.yaml", ["+data@data.init_args.inner=rows"])  # the entry's package wins
    assert placed.data == {"init_args": {"inner": {"rows": 9}}, "class_path": "pkg.Rows"}


def test_command_line_group_edits(project: Path) -> None:
    assert load_recipe(project / "job.yaml", ["~model"]).model is None
    assert load_recipe(project / "job.yaml", ["model=null"]).model is None  # Hydra's null choice: no option
    assert load_recipe(project / "job.yaml", ["+data=rows"]).data["init_args"] == {"rows": 9}
    with pytest.raises(RecipeError, match=r"'\+trainer=fast': group 'trainer' is already in the defaults list "
                                          r"\(slow, from recipe .*base\.yaml\): choose with trainer=fast"):
        load_recipe(project / "job.yaml", ["+trainer=fast"])
    with pytest.raises(RecipeError, match=r"'~trainer=fast': nothing to drop: the defaults list has no trainer=fast "
                                          r"\(its choices: slow\)"):
        load_recipe(project / "job.yaml", ["~trainer=fast"])


def test_a_command_line_choice_replaces_the_groups_choice_and_the_recipes_own_keys_win(project: Path) -> None:
    # job.yaml overrides base's ft: near with far, keeping a checkpoint folder in its own body: choosing ft=far on
    # the command line is what the recipe already chose, so nothing changes, as in Hydra.
    as_written = load_recipe(project / "job.yaml")
    assert load_recipe(project / "job.yaml", ["ft=far"]) == as_written
    assert (as_written.ft.checkpoint_dir, as_written.ft.checkpoint_every_n_steps, as_written.ft.lr_scaling) == (
        "ckpt", 0, "linear")  # near's checkpoint_every_n_steps went with it: replaced, not layered
    swapped = load_recipe(project / "job.yaml", ["ft=near"])
    assert (swapped.ft.checkpoint_every_n_steps, swapped.ft.lr_scaling) == (5, "none")
    assert load_recipe(project / "job.yaml", ["trainer=fast"]).trainer.seed == 7  # the recipe's own keys still win


@pytest.mark.parametrize(("text", "first"), [
    ("defaults:\n  - base\n  - ft: far\n", r"near from recipe .*base\.yaml"),  # over an included recipe's choice
    ("defaults:\n  - ft: near\n  - ft: far\n", r"near from recipe .*twice\.yaml"),  # in one file
])
def test_a_group_named_twice_in_a_defaults_tree_is_refused_naming_override(project: Path, text: str,
                                                                            first: str) -> None:
    (project / "twice.yaml").write_text(text)
    with pytest.raises(RecipeError, match=rf"twice\.yaml: multiple values for ft \({first}, then far\): a group has "
                                          r"one entry in a defaults list, as in Hydra; to replace the earlier choice "
                                          r"write 'override ft: far'"):
        load_recipe(project / "twice.yaml")


def test_a_groups_option_is_a_yaml_string_and_one_option(project: Path) -> None:
    assert load_recipe(project / "job.yaml", ["trainer='fast'"]) == load_recipe(project / "job.yaml", ["trainer=fast"])
    with pytest.raises(RecipeError, match=r"override 'trainer=\[slow,fast\]': several options of one group are not "
                                          r"supported: choose one \(trainer=OPTION\), or run one job per option with "
                                          r"fthsdp launch -m trainer=A,B"):
        load_recipe(project / "job.yaml", ["trainer=[slow,fast]"])


def test_the_shipped_gpu_recipe_keeps_its_checkpoint_settings_under_its_own_ft_choice() -> None:
    recipe = ROOT / "recipes" / "llama_gpu.yaml"
    assert load_recipe(recipe, ["ft=datacenter"]) == load_recipe(recipe)
    assert load_recipe(recipe, ["ft=datacenter"]).ft.checkpoint_dir == "checkpoints"


@pytest.mark.parametrize(("override", "expected"), [
    ("hydra.run.dir=out", r"Hydra's own settings \(hydra\.\*, hydra/launcher=\.\.\.\) are not supported"),
    ("hydra/launcher=joblib", r"Hydra's own settings .* are not supported"),
    ("trainer.max_steps=range(1,4)", r"Hydra's sweep and cast functions \(range\(1,4\)\) are not supported"),
    ("trainer.max_steps=choice(1,2)", r"functions \(choice\(1,2\)\) are not supported"),
    ("model/small=net", r"nested config groups \(model/small\) are not supported"),
    ("trainer@a:b=fast", r"renaming a package \(group@from:to\) is not supported"),
    ("++trainer=fast", r"force-add of a config group \(\+\+trainer=\.\.\.\) is not supported"),
])
def test_hydra_syntax_beyond_the_grammar_is_refused_as_not_supported(project: Path, override: str,
                                                                     expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        load_recipe(project / "job.yaml", [override])


@pytest.mark.parametrize(("entry", "expected"), [
    ("  - trainer: [slow, fast]\n", r"several options of one group \(a list\) are not supported"),
    ("  - trainer: ${oc.env:OPTION}\n", r"interpolation in a defaults list is not supported"),
    ("  - trainer/cpu: slow\n", r"nested config groups \(trainer/cpu\) are not supported"),
    ("  - always trainer: slow\n", r"only 'override' and 'optional' may come before a group"),
])
def test_defaults_syntax_beyond_the_grammar_is_refused(project: Path, entry: str, expected: str) -> None:
    (project / "odd.yaml").write_text(f"defaults:\n{entry}")
    with pytest.raises(RecipeError, match=rf"odd\.yaml: .*{expected}"):
        load_recipe(project / "odd.yaml")


def test_a_sweep_needs_dash_m_and_a_quoted_comma_is_one_value(project: Path) -> None:
    with pytest.raises(RecipeError, match=r"'trainer=slow,fast' has 2 comma-separated values: a sweep runs one job "
                                          r"per value with fthsdp launch -m; without -m, choose one option "
                                          r"\(trainer=slow\)$"):  # a group takes no list: no bracketing advice
        load_recipe(project / "job.yaml", ["trainer=slow,fast"])
    with pytest.raises(RecipeError, match=r"'trainer\.seed=1,2' has 2 .*quote it \(trainer\.seed='a,b'\); for a list, "
                                          r"bracket it \(trainer\.seed=\[a,b\]\)"):
        load_recipe(project / "job.yaml", ["trainer.seed=1,2"])
    quoted = load_recipe(project / "job.yaml", ["launch.chaos='kill:at=step5,kill:at=step7'"])
    assert quoted.launch.chaos == "kill:at=step5,kill:at=step7"
    assert load_recipe(project / "job.yaml", ["+model.init_args.sizes=[1,2]"]).model["init_args"]["sizes"] == [1, 2]


def test_a_sweep_expands_to_every_combination_the_last_varying_fastest() -> None:
    assert expand(["model=a,b", "trainer.max_steps=1,2", "ft=x"]) == [
        ["model=a", "trainer.max_steps=1", "ft=x"], ["model=a", "trainer.max_steps=2", "ft=x"],
        ["model=b", "trainer.max_steps=1", "ft=x"], ["model=b", "trainer.max_steps=2", "ft=x"]]
    assert expand(["+model.init_args.sizes=[1,2],[3]", "data@data.x=p"]) == [
        ["+model.init_args.sizes=[1,2]", "data@data.x=p"], ["+model.init_args.sizes=[3]", "data@data.x=p"]]


def test_launch_refuses_hydras_application_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in (["--cfg", "job"], ["-c", "job"], ["--config-name", "x"], ["-cp", "conf"]):
        with pytest.raises(SystemExit):
            main(["launch", str(ROOT / "recipes" / "mlp.yaml"), *flag])
        assert f"{flag[0]} is Hydra's and not supported" in capsys.readouterr().err


def test_the_token_is_refused_through_every_prefix(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTHSDP_TOKEN", "s3cret-token")
    for override in ("+model.init_args.key=${oc.env:FTHSDP_TOKEN}", "++model.init_args.key=s3cret-token"):
        with pytest.raises(RecipeError, match=r"FTHSDP_TOKEN, the job's secret") as refused:
            load_recipe(project / "job.yaml", [override])
        assert "s3cret-token" not in str(refused.value)
