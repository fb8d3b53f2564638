"""The Hugging Face examples' model and data (``examples/hf_models.py``), in process: the shapes the launch tests
rely on (GPT-2's tie, Llama's own head), the same data in every process, and how the Lightning strategy's policy
shards them (each decoder layer a unit, the tied head and embedding in the root)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from tests.hf.requires import ENV_REQUIRE_HF, require_transformers
from tests.paths import EXAMPLES

require_transformers()
sys.path.insert(0, str(EXAMPLES))  # the examples import hf_models as `python examples/...` finds it

from hf_models import VOCAB, MarkovTokens, causal_lm  # noqa: E402  (after the skip and the path)


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


def test_without_transformers_the_tests_skip_saying_why_and_fail_where_required(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    monkeypatch.delenv(ENV_REQUIRE_HF, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"transformers cannot be imported \(.*\): pip install -e \.\[hf\]"):
        require_transformers()
    monkeypatch.setenv(ENV_REQUIRE_HF, "1")
    with pytest.raises(pytest.fail.Exception, match=r"although \$FTHSDP_REQUIRE_HF is set"):
        require_transformers()
