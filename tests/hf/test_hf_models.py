"""The Hugging Face examples' model and data (``examples/hf_models.py``), in process: the shapes the launch tests
rely on (GPT-2's tie, Llama's own head), the same data in every process, and how the Lightning strategy's policy
shards them (each decoder layer a unit, the tied head and embedding in the root), and the demos' pacing: a
callback or a marked call, never part of the model, and only when its flag is given."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.hf.requires import ENV_REQUIRE_HF, require_transformers
from tests.paths import EXAMPLES

require_transformers()
sys.path.insert(0, str(EXAMPLES))  # the examples import hf_models as `python examples/...` finds it

import hf_models  # noqa: E402  (after the skip and the path)
from hf_models import VOCAB, MarkovTokens, StepPace, causal_lm  # noqa: E402


def test_gpt2_ties_its_head_to_the_embedding_and_llama_does_not() -> None:
    gpt2, llama = causal_lm("gpt2", context=16), causal_lm("llama", context=16)
    assert type(gpt2).__name__ == "GPT2LMHeadModel" and type(llama).__name__ == "LlamaForCausalLM"
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # grouped-query attention
    tokens = torch.randint(VOCAB, (2, 16))
    for model in (gpt2, llama):
        out = model(input_ids=tokens, labels=tokens)
        assert out.logits.shape == (2, 16, VOCAB) and out.loss.item() == pytest.approx(5.5, abs=0.3)  # ~ln 256


def test_an_unknown_arch_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--arch 'bert' is not one of llama, gpt2"):
        causal_lm("bert", context=16)


def test_every_process_reads_the_same_sequences_of_the_chain() -> None:
    data, again = MarkovTokens(32, context=12), MarkovTokens(32, context=12)
    assert len(data) == 32 and data.floor == pytest.approx(torch.log(torch.tensor(4.0)).item())
    for index in (0, 7, 31):
        item = data[index]
        assert torch.equal(item["input_ids"], again[index]["input_ids"]) and item["labels"] is item["input_ids"]
        tokens = item["input_ids"].tolist()
        assert all(b in data.successors[a].tolist() for a, b in itertools.pairwise(tokens))
    assert not torch.equal(data[0]["input_ids"], data[1]["input_ids"])


@pytest.mark.parametrize(("arch", "layers"), [("llama", "model.model.layers"), ("gpt2", "model.transformer.h")])
def test_the_strategy_shards_each_decoder_layer_and_leaves_the_rest_to_the_root(arch: str, layers: str) -> None:
    from lightning_fthsdp.lightning.policy import shard_units
    from train_hf_lightning import HFCausalLM

    module = HFCausalLM(arch, context=16)
    assert shard_units(module) == list(module.get_submodule(layers))


def pads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pads ``StepPace`` asks for, instead of sleeping them."""
    asked: list[float] = []
    monkeypatch.setattr(hf_models, "sleep", asked.append)
    return asked


def pace_flags(*argv: str) -> StepPace | None:
    parser = argparse.ArgumentParser()
    StepPace.add_flags(parser)
    return StepPace.from_flags(parser, parser.parse_args(argv))


def test_the_pace_pads_steps_while_its_file_exists_and_not_after(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    asked, pace_file = pads(monkeypatch), tmp_path / "pace"
    pace_file.touch()
    pace = pace_flags("--min-step-time-s", "30", "--pace-file", str(pace_file))
    assert pace is not None
    pace.step_ended()
    pace.step_ended()
    assert len(asked) == 2 and all(0 < pad <= 30 for pad in asked), asked
    pace_file.unlink()  # what the launch tests do once the restarted group trains again
    pace.step_ended()
    assert len(asked) == 2


def test_no_pacing_flag_means_no_pace_and_a_pointless_or_bad_one_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert pace_flags() is None and pace_flags("--min-step-time-s", "0") is None
    for argv, message in [(("--pace-file", "p"), "--pace-file p paces nothing without a --min-step-time-s above 0"),
                          (("--min-step-time-s", "-1"), "--min-step-time-s must be a finite number > 0, got -1.0"),
                          (("--min-step-time-s", "inf"), "--min-step-time-s must be a finite number > 0, got inf")]:
        with pytest.raises(SystemExit) as exited:
            pace_flags(*argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_lightning_module_has_no_pacing_and_the_demo_callback_paces_each_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl

    from train_hf_lightning import DemoPace, HFCausalLM

    assert {name for name in vars(HFCausalLM) if not name.startswith("__")} == {"training_step",
                                                                                 "configure_optimizers"}
    asked, steps = pads(monkeypatch), 3
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[DemoPace(StepPace(30))])
    module = HFCausalLM("gpt2", context=16, steps=steps)
    trainer.fit(module, DataLoader(MarkovTokens(16, context=16), batch_size=4))
    assert trainer.global_step == steps and len(asked) == steps, asked


def test_without_transformers_the_tests_skip_saying_why_and_fail_where_required(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    monkeypatch.delenv(ENV_REQUIRE_HF, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"transformers cannot be imported \(.*\): pip install -e \.\[hf\]"):
        require_transformers()
    monkeypatch.setenv(ENV_REQUIRE_HF, "1")
    with pytest.raises(pytest.fail.Exception, match=r"although \$FTHSDP_REQUIRE_HF is set"):
        require_transformers()
