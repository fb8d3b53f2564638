"""Issue 29, item 7: a wrong job is refused before it starts. A chaos step the job never reaches, a precision the
strategy refuses, a lighthouse whose quorum can never form; ``fthsdp --version``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_fthsdp import __version__
from lightning_fthsdp.launch import chaos
from lightning_fthsdp.recipes.loader import RecipeError, load_recipe
from tests.paths import ROOT

MLP = ROOT / "recipes" / "mlp.yaml"


def test_version_prints_the_packages_version() -> None:
    result = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fthsdp (lightning-fthsdp) {__version__}"


@pytest.mark.parametrize(("spec", "message"), [
    ("kill:at=step30", "strikes at step 30"),
    ("kill:at=step20", "strikes at step 20"),  # the last step: no group is short of it any more
    ("kill:every=step25", "strikes at step 25"),
    ("kill:every=step7:count=3", "makes its injection 3 at step 21"),
    ("hang:at=1s,kill:at=step40:group=b", "kill:at=step40:group=b"),
])
def test_a_chaos_step_the_job_never_reaches_is_refused(spec: str, message: str) -> None:
    faults = chaos.parse(spec, ["a", "b"])
    with pytest.raises(ValueError, match=r"trainer\.max_steps") as refused:
        chaos.refuse_unreachable(faults, 20, "trainer.max_steps")
    assert message in str(refused.value) and "trainer.max_steps=20" in str(refused.value)


@pytest.mark.parametrize("spec", ["kill:at=step19", "kill:every=step5:count=3", "kill:every=step19",
                                  "kill:at=90s", "hang:every=1m", ""])
def test_chaos_within_the_job_or_on_its_clock_is_accepted(spec: str) -> None:
    chaos.refuse_unreachable(chaos.parse(spec, ["a", "b"]), 20, "trainer.max_steps")


def test_a_precision_the_strategy_refuses_is_refused_by_the_recipe_naming_the_accepted_ones() -> None:
    with pytest.raises(RecipeError) as refused:
        load_recipe(MLP, ["trainer.precision=16-mixed"])
    message = str(refused.value)
    assert "trainer.precision='16-mixed'" in message
    assert "32-true, bf16-mixed, bf16-true" in message


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_every_precision_the_recipe_accepts_is_one_the_strategy_accepts(precision: str) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_fthsdp.lightning.refusals import refuse_loss_scaling

    assert load_recipe(MLP, [f"trainer.precision={precision}"]).trainer.precision == precision
    # The plugin Lightning builds for it on this recipe's accelerator: the strategy's own refusal lets it through.
    plugin = _AcceleratorConnector(accelerator="cpu", precision=precision).precision_plugin
    refuse_loss_scaling(plugin)


def _lighthouse(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse", "--port", "0", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize(("argv", "message"), [
    (["--replica-ids", "a,b", "--min-replicas", "3"], "--min-replicas 3 exceeds the 2 groups of --replica-ids a,b"),
    (["--replica-ids", "a,a"], "a given more than once in --replica-ids 'a,a'"),
    (["--replica-ids", "a,b,a,b", "--min-replicas", "2"], "a, b given more than once"),
])
def test_a_lighthouse_that_could_never_form_a_quorum_is_refused_at_start(argv: list[str], message: str) -> None:
    lighthouse = _lighthouse(*argv)
    try:
        out, err = lighthouse.communicate(timeout=60)
    finally:
        if lighthouse.poll() is None:
            lighthouse.kill()
    assert lighthouse.returncode == 2 and message in err, err
    assert "listening" not in out


def test_a_lighthouse_whose_quorum_can_form_starts() -> None:
    """The control: the same flags with a reachable minimum start the lighthouse."""
    lighthouse = _lighthouse("--replica-ids", "a,b", "--min-replicas", "2")
    try:
        assert lighthouse.stdout is not None
        line = lighthouse.stdout.readline()  # its one line, once both ports are bound (or EOF if it exits)
        assert line.startswith("fthsdp lighthouse listening on http://127.0.0.1:"), line
    finally:
        lighthouse.terminate()
        lighthouse.communicate(timeout=30)
