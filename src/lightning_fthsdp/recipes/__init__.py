"""Structured configs (``schema``) and the recipe loader: omegaconf YAML, defaults composition, overrides."""

from __future__ import annotations

from lightning_fthsdp.config.timeouts import field_docs
from lightning_fthsdp.recipes.loader import RecipeError, load_recipe, to_yaml
from lightning_fthsdp.recipes.schema import (
    FTConfig,
    LaunchConfig,
    RecipeConfig,
    TrainerConfig,
)

__all__ = ["FTConfig", "LaunchConfig", "RecipeConfig", "RecipeError", "TrainerConfig", "field_docs", "load_recipe",
           "to_yaml"]
