"""Defaults lists, Hydra's grammar: what each entry means, the tree they build and how the command line edits it.

Entries of a recipe's ``defaults``: ``base`` (another recipe in its folder), ``group: option`` (a config group's
option), ``group@package: option`` (its keys placed under ``package``: ``_global_``, ``_group_`` or a dotted key),
``override group: option`` (replaces the choice an earlier entry, or a recipe it includes, made), ``optional group:
option`` (nothing when the option does not exist), ``group: null`` (no option) and ``_self_`` (where the file's own
keys merge; without it, last). A group (at one package) has one entry in the whole tree, as in Hydra: a second one,
in the same file or in a recipe it includes, is refused ("Multiple values"); ``override group: option`` replaces
the earlier choice, and keys to keep from the option it replaced go in the recipe's own body.

The command line, with Hydra's precedence over every file: ``group=option`` replaces the group's choice; for a
group the tree never names it is refused, naming ``+group=option``, which appends it (and is refused for a group
already named); ``~group`` (``~group=option``: only while that is its choice) drops the group. Where an option's
keys go: see ``place``.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_fthsdp.recipes import groups
from lightning_fthsdp.recipes.overrides import Override

SELF = "_self_"
GLOBAL = "_global_"
_KEYWORDS = ("override", "optional")
_HEADER = re.compile(r"#\s*@package\s+(\S+)")


class DefaultsError(ValueError):
    """A defaults entry or a command-line group override that does not fit; the message names it and the fix."""


@dataclass
class Choice:
    """One group entry of the tree: the option chosen and where that choice was made."""

    group: str
    package: str | None
    option: str | None
    """None: ``group: null``, no option."""
    source: str
    optional: bool = False

    def matches(self, group: str, package: str | None) -> bool:
        return self.group == group and (self.package or GLOBAL) == (package or GLOBAL)


@dataclass
class Recipe:
    """One recipe file of the tree: its own keys and its defaults, in order (``SELF`` where its keys go)."""

    path: Path
    raw: DictConfig
    entries: list[Recipe | Choice | str] = field(default_factory=list)

    def choices(self) -> Iterator[Choice]:
        """Every group entry of the tree under this recipe, in merge order."""
        for entry in self.entries:
            if isinstance(entry, Choice):
                yield entry
            elif isinstance(entry, Recipe):
                yield from entry.choices()


def parse_entry(entry: Any, source: str) -> tuple[str, str] | tuple[str, Choice]:
    """("self", SELF), ("recipe", NAME), ("choice", Choice) or ("override", Choice) of one defaults entry."""
    if isinstance(entry, str):
        if "${" in entry:
            raise DefaultsError(f"{source}: defaults entry {entry!r}: interpolation in a defaults list is not "
                                "supported: name the recipe")
        return ("self", SELF) if entry == SELF else ("recipe", entry)
    if not isinstance(entry, DictConfig) or len(entry) != 1:
        raise DefaultsError(f"{source}: a defaults entry is a recipe name (base) or one group: option "
                            f"(model: tiny_gpt), got {entry!r}")
    head, option = next(iter(typing.cast(dict, OmegaConf.to_container(entry, resolve=False)).items()))
    head = str(head)
    *keywords, name = head.split()
    unknown = [k for k in keywords if k not in _KEYWORDS]
    if unknown or len(set(keywords)) != len(keywords):
        raise DefaultsError(f"{source}: defaults entry {head!r}: only 'override' and 'optional' may come before a "
                            "group")
    group, _, package = name.lstrip("/").partition("@")
    if "/" in group:
        raise DefaultsError(f"{source}: defaults entry {head!r}: nested config groups ({group}) are not supported; "
                            f"groups: {', '.join(sorted(groups.GROUPS))}")
    if ":" in package:
        raise DefaultsError(f"{source}: defaults entry {head!r}: renaming a package (group@from:to) is not "
                            "supported: name the package the option goes to")
    try:
        groups.check_group(group)
    except groups.GroupError as err:
        raise DefaultsError(f"{source}: {err}") from None
    if isinstance(option, (dict, list)):
        raise DefaultsError(f"{source}: defaults entry {head}: several options of one group (a list) are not "
                            "supported: one entry per option, later ones merge over earlier ones")
    if isinstance(option, str) and "${" in option:
        raise DefaultsError(f"{source}: defaults entry {head}: {option}: interpolation in a defaults list is not "
                            "supported: name the option")
    choice = Choice(group, package or None, None if option is None else str(option), source,
                    optional="optional" in keywords)
    return ("override" if "override" in keywords else "choice", choice)


def override_in_file(node: Recipe, choice: Choice) -> None:
    """``override group: option`` in ``node``'s defaults: the choice of the group's last layer so far."""
    target = _last(node, choice.group, choice.package)
    if target is None:
        raise DefaultsError(f"{choice.source}: 'override {choice.group}: {choice.option}' overrides nothing: no "
                            f"entry before it (nor a recipe it includes) chooses {choice.group}; drop 'override' to "
                            "add the group")
    target.option, target.source = choice.option, choice.source


def refuse_repeats(top: Recipe) -> None:
    """One entry per group and package in the tree under ``top``, as Hydra requires; the message names both and the
    fix (``override``)."""
    seen: list[Choice] = []
    for choice in top.choices():
        first = next((c for c in seen if c.matches(choice.group, choice.package)), None)
        if first is not None:
            name = choice.group + (f"@{choice.package}" if choice.package else "")
            raise DefaultsError(f"{choice.source}: multiple values for {name} ({first.option} from {first.source}, "
                                f"then {choice.option}): a group has one entry in a defaults list, as in Hydra; to "
                                f"replace the earlier choice write 'override {name}: {choice.option}', and put the "
                                "keys to keep from the option it replaces in the recipe's own body")
        seen.append(choice)


def apply_command_line(top: Recipe, overrides: Sequence[Override]) -> None:
    """The command line's group overrides, in order, over every file's choices (see the module's docstring)."""
    for override in overrides:
        value = override.option
        matching = [c for c in top.choices() if c.matches(override.key, override.package)]
        if override.prefix == "~":
            dropped = [c for c in matching if value is None or c.option == value]
            if not dropped:
                named = ", ".join(sorted({str(c.option) for c in matching})) or "none"
                raise DefaultsError(f"{override.describe()}: nothing to drop: the defaults list has no "
                                    f"{override.key}{'=' + value if value is not None else ''} (its choices: "
                                    f"{named})")
            _remove(top, dropped)
            continue
        if override.prefix == "+" and matching:
            raise DefaultsError(f"{override.describe()}: group {override.key!r} is already in the defaults list "
                                f"({matching[-1].option}, from {matching[-1].source}): choose with "
                                f"{override.text.lstrip('+')}")
        if matching:
            matching[-1].option, matching[-1].source = value, override.describe()
        elif override.prefix == "":
            named = ", ".join(sorted({c.group for c in top.choices()})) or "none"
            raise DefaultsError(f"{override.describe()}: could not override {override.key}: the defaults list names "
                                f"no {override.key} (its groups: {named}); to append it: +{override.text}")
        else:
            choice = Choice(override.key, override.package, value, override.describe())
            top.entries.append(choice)  # after an explicit _self_; before the implicit one, which comes last


def place(content: DictConfig, group: str, package: str | None, path: Path) -> DictConfig:
    """An option's keys where its package says: the entry's ``@package``, else its file's ``# @package`` line, else
    the top level where its keys are the sections its group sets (``model: {class_path: ...}``, as the shipped
    options are written), else under the group's name (Hydra's default: a file of just ``_target_: ...``)."""
    own = set(map(str, content)) <= set(groups.GROUPS[group])
    where = package or file_package(path) or (GLOBAL if own else "_group_")
    if where == GLOBAL:
        return content
    dotted = group if where == "_group_" else where.replace("_group_", group)
    for name in reversed(dotted.split(".")):
        content = OmegaConf.create({name: content})
    return content


def file_package(path: Path) -> str | None:
    """The ``# @package X`` line among the comments that open ``path``, if any."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return None
        found = _HEADER.match(line)
        if found:
            return found.group(1)
    return None


def _last(node: Recipe, group: str, package: str | None) -> Choice | None:
    return next((c for c in reversed(list(node.choices())) if c.matches(group, package)), None)


def _remove(node: Recipe, dropped: list[Choice]) -> None:
    node.entries = [e for e in node.entries if not any(e is d for d in dropped)]
    for entry in node.entries:
        if isinstance(entry, Recipe):
            _remove(entry, dropped)
