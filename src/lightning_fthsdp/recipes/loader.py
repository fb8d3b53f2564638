"""Recipes: omegaconf YAML with ``defaults`` composition, config groups and overrides, validated against the schema.

Composition: a recipe may start with a ``defaults`` list. Each entry is another recipe in the same folder (``base``
or ``base.yaml``), a config group's option (``model: tiny_gpt``, a file ``configs/model/tiny_gpt.yaml`` found as
``lightning_fthsdp.recipes.groups`` says) or one of Hydra's forms (``_self_``, ``override``, ``optional``,
``group@package``: ``lightning_fthsdp.recipes.defaults``); entries compose recursively and merge in order, the
recipe's own keys where ``_self_`` stands (else on top). The command line's list is Hydra's override grammar
(``lightning_fthsdp.recipes.overrides``): its group edits (``model=mlp``, ``+group=option``, ``~group``) change the
defaults tree before it is merged, with Hydra's precedence; its key overrides (``key=value``, ``+key=value``,
``++key=value``, ``~key``) are applied last, in order, each checked against what the recipe sets. Every key must
exist in ``lightning_fthsdp.recipes.schema``; every value must have the field's type, be one of its ``choices``, and a
number finite and within its ``min`` and ``max``; then each section's ``check()`` and the ``Timeouts`` hierarchy
run. A ``defaults`` entry resolves only inside the recipe's folder and the config folders, and a
group's option is a name, never a path. No value may read or hold the job's token (``$FTHSDP_TOKEN``). Any
violation raises ``RecipeError`` naming the source (file or override), the key, the value and what is allowed; an
unknown group, option or key lists the ones that exist.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_fthsdp.config.env import ENV_TOKEN
from lightning_fthsdp.recipes import defaults, groups, retired
from lightning_fthsdp.recipes.overrides import Override, OverrideError, sweep_refusal
from lightning_fthsdp.recipes.overrides import parse as parse_override
from lightning_fthsdp.recipes.schema import MAGNITUDE, RecipeConfig


class RecipeError(ValueError):
    """A recipe or override that does not fit the schema; the message names key, value and allowed values."""


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Compose ``path`` with the group overrides among ``overrides`` (``group=option``, ``+group=option``,
    ``~group``), apply the key overrides (``key=value``, ``+key=value``, ``++key=value``, ``~key``; YAML values) in
    order, validate; return the typed recipe. ``path`` None: no recipe file, the schema's defaults (groups' options
    from ``configs/`` here, then the package's). The grammar: ``lightning_fthsdp.recipes.overrides``.

    A value that reads or holds the job's token (``$FTHSDP_TOKEN``) is refused: a recipe is written to the run's
    ``recipe.yaml`` and report, shown by ``--print-config`` and may name folders, and the token must reach none of
    them. No error message carries the token."""
    try:
        return _load(Path(path) if path is not None else None, overrides)
    except RecipeError as err:
        raise RecipeError(_redact(str(err))) from None


def _load(path: Path | None, overrides: Sequence[str]) -> RecipeConfig:
    parsed = split_overrides(overrides)
    label = f"recipe {path}" if path is not None else "the schema's defaults (no recipe)"
    composer = _Composer(groups.search_path(path), path or Path.cwd() / "recipe.yaml")
    try:
        top = composer.build(path) if path is not None else defaults.Recipe(Path.cwd(), OmegaConf.create({}))
        defaults.apply_command_line(top, [o for o in parsed if o.is_group])
        plain = composer.compose(top)  # what the files and the choices set: the keys ~ and + look at
    except defaults.DefaultsError as err:
        raise RecipeError(str(err)) from None
    merged = _merge(OmegaConf.structured(RecipeConfig), plain, label)
    key_overrides = [o for o in parsed if not o.is_group]
    for override in key_overrides:
        plain, merged = _apply(override, plain, merged)
    _refuse_token_interpolation(merged, f"{label}{_with(overrides)}")
    try:
        recipe = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # first: an interpolation that resolves nothing is a ValueError too
        where = f"{err.full_key}: " if getattr(err, "full_key", None) else ""
        raise RecipeError(f"{label}{_with(overrides)}: {where}{_first_line(err)}") from None
    except ValueError as err:  # Timeouts.__post_init__: the hierarchy, with every value in the message
        raise RecipeError(f"{label}: ft.timeouts: {err}") from None
    assert isinstance(recipe, RecipeConfig)
    try:
        _refuse_token_value(recipe, "")
        _check_fields(recipe, "")
    except ValueError as err:
        raise RecipeError(f"{label}{_with(overrides)}: {err}") from None
    return recipe


def split_overrides(overrides: Sequence[str]) -> list[Override]:
    """One command line's list, parsed (``recipes.overrides``): a sweep, a name that is neither a group nor a key,
    or one group chosen twice differently is refused here."""
    parsed: list[Override] = []
    top_level = [f.name for f in dataclasses.fields(RecipeConfig)]
    for text in overrides:
        try:
            override = parse_override(text)
            if override.is_sweep:
                raise RecipeError(sweep_refusal(override))
            option = override.option if override.is_group else None  # a group's option parses here, or is refused
        except OverrideError as err:
            raise RecipeError(str(err)) from None
        old_form = retired.refusal([override.key.partition(".")[0]], override.describe())
        if old_form is not None:
            raise RecipeError(old_form)
        if override.is_group:
            same = [o for o in parsed if o.is_group and o.prefix == override.prefix == ""
                    and (o.key, o.package) == (override.key, override.package) and o.option != option]
            if same:
                raise RecipeError(f"{override.describe()} contradicts {same[0].text} given before: choose once")
        elif not ("." in override.key or override.key in top_level):
            raise RecipeError(f"{override.describe()}: {override.key!r} is neither a config group nor a key; groups: "
                              f"{', '.join(sorted(groups.GROUPS))}; keys: {', '.join(top_level)} (and their fields, "
                              "e.g. trainer.max_steps=50)")
        parsed.append(override)
    return parsed


def _apply(override: Override, plain: DictConfig, merged: DictConfig) -> tuple[DictConfig, DictConfig]:
    """One key override over (what the files and earlier overrides set, that merged over the schema), Hydra's way:
    ``key=`` sets a key the config has, ``+key=`` adds one without a value, ``++key=`` either, ``~key`` removes what
    was set (the schema's default applies again)."""
    key, source = override.key, override.describe()
    current = OmegaConf.select(merged, key, default=_MISSING, throw_on_resolution_failure=False)
    if override.prefix == "~":
        if current is _MISSING:
            raise RecipeError(f"{source}: could not delete {key}: the recipe has no such key")
        if override.value is not None and _value(key, override.value) != _plain(current):
            raise RecipeError(f"{source}: could not delete {key}: its value is {_plain(current)!r}, not "
                              f"{_value(key, override.value)!r}")
        _delete(plain, key)
        return plain, _merge(OmegaConf.structured(RecipeConfig), plain, source)
    update = OmegaConf.from_dotlist([f"{key}={override.value}"])
    if override.prefix == "" and current is _MISSING:
        _merge(merged, update, source)  # a key the schema does not have: its error lists the ones it has
        raise RecipeError(f"{source}: could not override {key}: the recipe has no such key; to add it: "
                          f"+{override.text}")
    if override.prefix == "+" and current not in (_MISSING, None) and not OmegaConf.is_config(
            OmegaConf.select(update, key)):
        raise RecipeError(f"{source}: could not append to the recipe: {key} is already {_plain(current)!r}; set it "
                          f"with {override.text[1:]}, or add or set it with +{override.text}")
    return typing.cast(DictConfig, OmegaConf.merge(plain, update)), _merge(merged, update, source)


def _value(key: str, text: str) -> Any:
    """An override's value as YAML reads it."""
    return _plain(OmegaConf.select(OmegaConf.from_dotlist([f"{key}={text}"]), key))


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _delete(plain: DictConfig, key: str) -> None:
    """Remove ``key`` from what the files set; nothing when they never set it (it has the schema's default)."""
    section, _, name = key.rpartition(".")
    parent = OmegaConf.select(plain, section, default=None, throw_on_resolution_failure=False) if section else plain
    if isinstance(parent, DictConfig) and name in parent:
        parent.pop(name)


def to_yaml(recipe: RecipeConfig) -> str:
    """The fully resolved recipe (every field), loadable by ``load_recipe`` with the same result."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


class _Composer:
    """Builds one recipe's defaults tree (``recipes.defaults``), lets the command line edit it, then merges it."""

    def __init__(self, folders: list[Path], recipe: Path) -> None:
        self.folders = folders
        # A defaults entry names a recipe in the top recipe's folder or a config folder, never a file elsewhere.
        self.roots = [recipe.parent.resolve(), *(f.resolve() for f in folders)]

    def build(self, path: Path, stack: tuple[Path, ...] = ()) -> defaults.Recipe:
        """``path``'s tree: the recipes it includes, built recursively, and its group entries, file-level
        ``override`` entries already applied; ``stack``: the recipes that include it."""
        raw = self._load(path, stack)
        entries = raw.pop("defaults", [])
        old_form = retired.refusal(map(str, raw), f"recipe {path}")
        if old_form is not None:
            raise RecipeError(old_form)
        if not isinstance(entries, ListConfig) and entries != []:
            raise RecipeError(f"recipe {path}: defaults must be a list of recipe names and group: option entries, "
                              f"got {entries!r}")
        node = defaults.Recipe(path, raw)
        for entry in entries:
            kind, parsed = defaults.parse_entry(entry, f"recipe {path}")
            if kind == "recipe":
                node.entries.append(self.build(self._inside(path, str(parsed)), (*stack, path.resolve())))
            elif kind == "override":
                defaults.override_in_file(node, typing.cast(defaults.Choice, parsed))
            else:
                node.entries.append(parsed)
        if not stack:  # the whole tree is built: one entry per group in it
            defaults.refuse_repeats(node)
        return node

    def compose(self, node: defaults.Recipe) -> DictConfig:
        """The tree merged in order: each entry, and the file's own keys where ``_self_`` stands (else last)."""
        entries = node.entries if defaults.SELF in node.entries else [*node.entries, defaults.SELF]
        parts = []
        for entry in entries:
            if entry == defaults.SELF:
                parts.append(node.raw)
            elif isinstance(entry, defaults.Recipe):
                parts.append(self.compose(entry))
            elif isinstance(entry, defaults.Choice) and entry.option is not None:
                parts.extend(self._option(entry))
        return typing.cast(DictConfig, OmegaConf.merge(*parts)) if len(parts) > 1 else parts[0]

    def _inside(self, path: Path, entry: str) -> Path:
        """The recipe a defaults entry of ``path`` names, refused unless it is inside the recipe's folder or a config
        folder (a recipe must not pull in, nor report the contents of, a file elsewhere)."""
        default = path.parent / (entry if entry.endswith(".yaml") else f"{entry}.yaml")
        if not any(default.resolve().is_relative_to(root) for root in self.roots):
            raise RecipeError(f"recipe {path}: defaults entry {entry!r} is {default.resolve()}, outside the recipe's "
                              f"folder and the config folders ({', '.join(map(str, self.roots))}): copy it into "
                              "one of them")
        return default

    def _option(self, choice: defaults.Choice) -> list[DictConfig]:
        """The option's keys, placed at its package ([] for an ``optional`` entry whose option does not exist)."""
        try:
            path = groups.option_file(choice.group, str(choice.option), self.folders)
        except groups.GroupError as err:
            if choice.optional:
                return []
            raise RecipeError(f"{choice.source}: {err}") from None
        composed = defaults.place(self.compose(self.build(path)), choice.group, choice.package, path)
        try:
            groups.check_owned(choice.group, [str(k) for k in composed], path)
        except groups.GroupError as err:
            raise RecipeError(str(err)) from None
        _merge(OmegaConf.structured(RecipeConfig), composed, f"{path} (an option of group {choice.group!r})")
        return [composed]

    @staticmethod
    def _load(path: Path, stack: tuple[Path, ...]) -> DictConfig:
        if not path.is_file():
            raise RecipeError(f"recipe {path} does not exist" + (f" (a default of {stack[-1]})" if stack else ""))
        if path.resolve() in stack:
            raise RecipeError(f"recipe {path}: its defaults include itself: "
                              f"{' -> '.join(map(str, (*stack, path)))}")
        try:
            raw = OmegaConf.load(path)
        except Exception as err:  # yaml's own errors carry the line and column
            raise RecipeError(f"recipe {path} is not valid YAML: {err}") from None
        if not isinstance(raw, DictConfig):
            raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
        return raw


_MISSING = object()


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
        metadata = next(f.metadata for f in dataclasses.fields(owner) if f.name == name)
        bounds = _bounds(metadata) if expected in (int, float) else ""
        return f"{key}={value!r} is not valid: expected {_type_name(expected)}{bounds}"
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
        if isinstance(value, int | float) and not isinstance(value, bool):
            _check_number(key, value, f.metadata)
        if dataclasses.is_dataclass(value):
            _check_fields(value, f"{key}.")
    if hasattr(section, "check"):
        section.check(prefix.rstrip(".") or "recipe")


def _refuse_token_interpolation(merged: DictConfig, source: str) -> None:
    """An interpolation naming ``$FTHSDP_TOKEN`` (``${oc.env:FTHSDP_TOKEN}``), refused before anything resolves it,
    whether or not the variable is set here (the groups and a relaunch have it)."""
    for key, text in _strings(OmegaConf.to_container(merged, resolve=False), ""):
        if "${" in text and ENV_TOKEN in text:
            raise RecipeError(f"{source}: {key}={text!r} reads ${ENV_TOKEN}, the job's secret: a recipe is written "
                              f"to the run's folder and report, so no value may hold it; give {key} a value of its "
                              "own")


def _refuse_token_value(recipe: Any, prefix: str) -> None:
    """A resolved value holding the token, by whatever route it came (a nested interpolation that assembles the
    variable's name, a pasted copy)."""
    token = os.environ.get(ENV_TOKEN)
    if not token:
        return
    for key, text in _strings(dataclasses.asdict(recipe), prefix):
        if token in text:
            raise ValueError(f"{key} holds the value of ${ENV_TOKEN}, the job's secret: a recipe is written to the "
                             f"run's folder and report, so no value may hold it; give {key} a value of its own")


def _strings(tree: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(dotted key, text) of every string in a nested mapping (lists by index)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for name, value in items:
        key = f"{prefix}{name}"
        if isinstance(value, str):
            yield key, value
        else:
            yield from _strings(value, f"{key}.")


def _redact(message: str) -> str:
    token = os.environ.get(ENV_TOKEN)
    return message.replace(token, f"<${ENV_TOKEN}>") if token else message


def _check_number(key: str, value: float, metadata: Mapping[str, Any]) -> None:
    """Finite, at least the field's ``min``, at most its ``max`` (else ``schema.MAGNITUDE``): NaN would pass every
    comparison, and a magnitude no job has is a typo that would surface hours later."""
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not allowed; allowed values: a finite number{_bounds(metadata)}")
    minimum, maximum = metadata.get("min"), metadata.get("max", MAGNITUDE)
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}={value!r} is too small; allowed values:{_bounds(metadata)}")
    if abs(value) > maximum:
        raise ValueError(f"{key}={value!r} is too large; allowed values:{_bounds(metadata)}")


def _bounds(metadata: Mapping[str, Any]) -> str:
    minimum, maximum = metadata.get("min"), metadata.get("max", MAGNITUDE)
    return (f" >= {minimum} and" if minimum is not None else f" >= {-maximum} and") + f" <= {maximum}"


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _with(overrides: Sequence[str]) -> str:
    return f" with overrides {' '.join(overrides)}" if overrides else ""
