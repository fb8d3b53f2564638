"""The Hugging Face side of ``train_hf_lightning.py`` and ``train_hf_accelerate.py``: a ``transformers`` causal LM
built from a config (random weights, nothing downloaded) and a token stream to train it on (generated, nothing
downloaded). Both examples train the same model on the same data; only the front end differs.

``llama`` is a small ``LlamaForCausalLM`` (rotary positions, grouped-query attention, SwiGLU, an untied output head);
``gpt2`` a small ``GPT2LMHeadModel`` (learned positions, its output head tied to the token embedding). Both use
Hugging Face's own classes unchanged; replace ``causal_lm`` with ``AutoModelForCausalLM.from_pretrained(...)`` and
``MarkovTokens`` with your tokenized corpus for a real run.

``StepPace`` is not part of either training script: it is the demos' pacing on one machine (``--min-step-time-s``),
which the examples attach from outside the model (a Lightning callback; a marked call in the Accelerate loop), and
only when that flag is given.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from time import monotonic, sleep

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel

ARCHS = ("llama", "gpt2")
VOCAB = 256


def causal_lm(arch: str, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> PreTrainedModel:
    """A causal LM of ``transformers``' own classes, shaped by ``arch`` (see the module docstring).

    Raises ValueError for an ``arch`` outside ``ARCHS``.
    """
    if arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                             max_position_embeddings=context, tie_word_embeddings=False)
    elif arch == "gpt2":
        # GPT-2's default token ids (50256) lie outside this vocabulary; dropout off keeps the tiny model's loss clean.
        config = GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=heads, n_positions=context,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=True)
    else:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}: choose one of them")
    return AutoModelForCausalLM.from_config(config)


class MarkovTokens(Dataset[dict[str, torch.Tensor]]):
    """Sequences of ``context`` tokens from a fixed random Markov chain in which each token has ``branching``
    possible successors, so a model that learns the chain reaches the loss ``ln(branching)`` (``floor``) and
    not below. Every process builds the same chain and the same sequences (seeded), so every replica group reads
    the same dataset; each item is Hugging Face's ``{"input_ids", "labels"}`` (the model shifts the labels)."""

    def __init__(self, size: int, context: int, branching: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(VOCAB, (VOCAB, branching), generator=generator)
        """The chain: ``successors[t]`` holds the tokens that may follow token ``t``."""
        self._size, self._context, self._branching, self._seed = size, context, branching, seed

    @property
    def floor(self) -> float:
        return math.log(self._branching)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + index + 1)
        choices = torch.randint(self._branching, (self._context,), generator=generator)
        tokens = torch.empty(self._context, dtype=torch.long)
        tokens[0] = choices[0] * (VOCAB // self._branching)  # a start that depends on the item only
        for position in range(1, self._context):
            tokens[position] = self.successors[tokens[position - 1], choices[position]]
        return {"input_ids": tokens, "labels": tokens}


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """The LR factor of committed step ``k``: linear warm-up over a tenth of ``steps``, then cosine decay to 0."""
    warmup = max(1, steps // 10)

    def factor(k: int) -> float:
        return min(1.0, (k + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))

    return factor


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags both examples take: the model, the run's length, the batch and the data."""
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--steps", type=int, default=150, help="train until this many committed steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and rank")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8192, help="sequences in the dataset")
    parser.add_argument("--lr", type=float, default=3e-3)


class StepPace:
    """Pads each step to ``min_step_time_s``: on one machine a tiny model's steps are shorter than a killed group's
    start (imports of torch, ``transformers`` and the front end), so without a pad the others would finish before it
    is back (the recipes' ``trainer.min_step_time_s``). With ``pace_file``, only while that file exists: a test lets
    go of the pace by deleting it once the group is back."""

    def __init__(self, min_step_time_s: float, pace_file: str | None = None) -> None:
        if not 0 < min_step_time_s < math.inf:  # NaN too
            raise ValueError(f"--min-step-time-s must be a finite number > 0, got {min_step_time_s}: give the pad "
                             "in seconds (0 or no flag: no pad)")
        self.min_step_time_s, self.pace_file = min_step_time_s, pace_file
        self._last = monotonic()

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        """The demos' pacing flags: none of them is needed to train."""
        parser.add_argument("--min-step-time-s", type=float,
                            help="demos on one machine: pad each step to this many seconds (default, 0: no pad)")
        parser.add_argument("--pace-file", help="with --min-step-time-s: pad steps only while this file exists")

    @classmethod
    def from_flags(cls, parser: argparse.ArgumentParser, args: argparse.Namespace) -> StepPace | None:
        """The pace that ``add_flags``' flags in ``args`` ask for; None without ``--min-step-time-s`` or with 0 (no
        pad, as the recipes' ``trainer.min_step_time_s: 0``). A ``--pace-file`` then (it would pace nothing) or a
        negative or non-finite pad is ``parser``'s usage error."""
        if not args.min_step_time_s:
            if args.pace_file is not None:
                parser.error(f"--pace-file {args.pace_file} paces nothing without a --min-step-time-s above 0: "
                             "give --min-step-time-s SECONDS too, or leave --pace-file out")
            return None
        try:
            return cls(args.min_step_time_s, args.pace_file)
        except ValueError as error:
            parser.error(str(error))

    def step_ended(self) -> None:
        if self.pace_file is None or os.path.exists(self.pace_file):
            sleep(max(0.0, self.min_step_time_s - (monotonic() - self._last)))
        self._last = monotonic()
