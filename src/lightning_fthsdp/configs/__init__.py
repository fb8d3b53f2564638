"""Structured configs (``schema``) and the recipe loader: omegaconf YAML, defaults composition, overrides."""

from __future__ import annotations

from lightning_fthsdp.configs.loader import RecipeError, load_recipe, to_yaml
from lightning_fthsdp.configs.schema import (
    FTConfig,
    LaunchConfig,
    LMConfig,
    RecipeConfig,
    RegressionConfig,
    TrainerConfig,
)
from lightning_fthsdp.core.config import field_docs

__all__ = ["FTConfig", "LMConfig", "LaunchConfig", "RecipeConfig", "RecipeError", "RegressionConfig",
           "TrainerConfig", "field_docs", "load_recipe", "to_yaml"]
