"""Recipes: omegaconf YAML with ``defaults`` composition and ``key=value`` overrides, validated against the schema.

Composition: a recipe may start with ``defaults: [name, ...]``; each name is another recipe in the same folder
(``.yaml`` optional), composed recursively and merged in order, then the recipe's own keys on top, then the
overrides in order. Every key must exist in ``lightning_fthsdp.recipes.schema``; every value must have the
field's type, be one of its ``choices`` and at least its ``min``; then each section's ``check()`` and the
``Timeouts`` hierarchy run. Any violation raises ``RecipeError`` naming the source (file or override), the key,
the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_fthsdp.config.renamed import deprecation
from lightning_fthsdp.recipes.schema import RecipeConfig


class RecipeError(ValueError):
    """A recipe or override that does not fit the schema; the message names key, value and allowed values."""


#: Keys renamed in 0.2 (one name per concept), still read until 0.3 with a FutureWarning: old -> new.
RENAMED_KEYS: dict[str, str] = {"launch.devices_per_replica": "launch.shard_count"}


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Compose ``path``, apply ``overrides`` (``key=value``, YAML values), validate; return the typed recipe."""
    path = Path(path)
    merged = OmegaConf.structured(RecipeConfig)
    merged = _merge(merged, _compose(path, ()), f"recipe {path}")
    _refuse_both_names(overrides)
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise RecipeError(f"override {override!r} is not key=value (e.g. trainer.max_steps=50)")
        if key in RENAMED_KEYS:
            _warn_renamed(f"override {override!r}", key)
            key = RENAMED_KEYS[key]
        merged = _merge(merged, OmegaConf.from_dotlist([f"{key}={value}"]), f"override {override!r}")
    try:
        recipe = OmegaConf.to_object(merged)
    except ValueError as err:  # Timeouts.__post_init__: the hierarchy, with every value in the message
        raise RecipeError(f"recipe {path}: ft.timeouts: {err}") from None
    except OmegaConfBaseException as err:
        raise RecipeError(f"recipe {path}: {_first_line(err)}") from None
    assert isinstance(recipe, RecipeConfig)
    try:
        _check_fields(recipe, "")
    except ValueError as err:
        raise RecipeError(f"recipe {path}{_with(overrides)}: {err}") from None
    return recipe


def to_yaml(recipe: RecipeConfig) -> str:
    """The fully resolved recipe (every field), loadable by ``load_recipe`` with the same result."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


def _compose(path: Path, stack: tuple[Path, ...]) -> DictConfig:
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist" + (f" (a default of {stack[-1]})" if stack else ""))
    if path.resolve() in stack:
        raise RecipeError(f"recipe {path}: its defaults include itself: {' -> '.join(map(str, (*stack, path)))}")
    try:
        raw = OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry the line and column
        raise RecipeError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
    defaults = raw.pop("defaults", [])
    _rename_keys(raw, f"recipe {path}")
    if not isinstance(defaults, ListConfig) and defaults != []:
        raise RecipeError(f"recipe {path}: defaults must be a list of recipe names, got {defaults!r}")
    parts = []
    for name in defaults:
        if not isinstance(name, str):
            raise RecipeError(f"recipe {path}: defaults entries are recipe names (strings), got {name!r}")
        default = path.parent / (name if name.endswith(".yaml") else f"{name}.yaml")
        parts.append(_compose(default, (*stack, path.resolve())))
    return typing.cast(DictConfig, OmegaConf.merge(*parts, raw)) if parts else raw


def _rename_keys(raw: DictConfig, source: str) -> None:
    """Move each renamed key of one file to its new name, in place (before the merge: the schema rejects it)."""
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(raw, old, default=_MISSING)
        if value is _MISSING:
            continue
        _warn_renamed(source, old)
        if OmegaConf.select(raw, new, default=_MISSING) not in (_MISSING, value):
            raise RecipeError(f"{source} sets both {old} (deprecated) and {new} to different values: keep {new}")
        section, _, name = old.rpartition(".")
        parent = OmegaConf.select(raw, section) if section else raw
        parent.pop(name)
        OmegaConf.update(raw, new, value, force_add=True)


_MISSING = object()


def _refuse_both_names(overrides: Sequence[str]) -> None:
    """A renamed key given under both names with different values is a mistake, as in one recipe file."""
    values = dict(override.partition("=")[::2] for override in overrides)
    for old, new in RENAMED_KEYS.items():
        if old in values and new in values and values[old] != values[new]:
            raise RecipeError(f"overrides set both {old}={values[old]} (deprecated) and {new}={values[new]}: "
                              f"keep {new}")


def _warn_renamed(source: str, old: str) -> None:
    warnings.warn(f"{source}: {deprecation(old, RENAMED_KEYS[old])}",
                  FutureWarning, stacklevel=3)


def _merge(base: DictConfig, update: DictConfig, source: str) -> DictConfig:
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, update))
    except OmegaConfBaseException as err:
        raise RecipeError(f"{source}: {_explain(err)}") from None


def _explain(err: OmegaConfBaseException) -> str:
    """Key, value and allowed values from omegaconf's error (which knows the dataclass and the key)."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    owner = getattr(err, "object_type", None)
    name = getattr(err, "key", None)
    if owner is not None and dataclasses.is_dataclass(owner) and isinstance(name, str):
        allowed = [f.name for f in dataclasses.fields(owner)]
        if name not in allowed:
            return f"unknown key {key!r}; allowed keys here: {', '.join(allowed)}"
        expected = typing.get_type_hints(owner)[name]
        value = getattr(err, "value", None)
        return f"{key}={value!r} is not valid: expected {_type_name(expected)}"
    return _first_line(err)


def _type_name(annotation: Any) -> str:
    if dataclasses.is_dataclass(annotation):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(annotation))}"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + " or null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(annotation,
                                                                                             str(annotation))


def _check_fields(section: Any, prefix: str) -> None:
    """choices and min of every field, sections recursively, then each section's own check()."""
    for f in dataclasses.fields(section):
        key, value = f"{prefix}{f.name}", getattr(section, f.name)
        choices: Iterable[str] | None = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{key}={value!r} is not allowed; allowed values: {', '.join(choices)}")
        minimum = f.metadata.get("min")
        if minimum is not None and value < minimum:
            raise ValueError(f"{key}={value!r} is too small; allowed values: >= {minimum}")
        if dataclasses.is_dataclass(value):
            _check_fields(value, f"{key}.")
    if hasattr(section, "check"):
        section.check(prefix.rstrip(".") or "recipe")


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _with(overrides: Sequence[str]) -> str:
    return f" with overrides {' '.join(overrides)}" if overrides else ""
