"""The recipe form before issue 29 (``task: lm | regression`` and its ``lm`` or ``regression`` section): no longer a
key of the schema, so it gets a refusal that says what to write instead, not "unknown key 'task'"."""

from __future__ import annotations

from collections.abc import Iterable

KEYS = ("task", "lm", "regression")
"""The old form's top-level keys."""


def refusal(keys: Iterable[str], source: str) -> str | None:
    """Why ``source`` (a recipe file or an override), which sets ``keys``, is refused; None when it sets none of
    ``KEYS``."""
    old = [key for key in keys if key in KEYS]
    if not old:
        return None
    return (f"{source}: {', '.join(old)}: recipes no longer choose a task; a recipe names its model and data "
            "(docs/recipes.md, \"Model and data\"). For task: lm, put model: tiny_gpt and data: stdlib_2mb in its "
            "defaults (the lm section's context, corpus_mb, batch_size and val_windows go under data.init_args, the "
            "rest under model.init_args); for task: regression, model: mlp and data: generated (samples, batch_size "
            "and val_samples under data.init_args, the rest under model.init_args); or name your own classes: "
            "model: {class_path: my.Module, init_args: {...}} (Hydra's _target_ works too)")
