"""Config groups: interchangeable fragments of a recipe in ``configs/GROUP/OPTION.yaml``, chosen by name.

A recipe's ``defaults`` list names a group's option (``- model: tiny_gpt``) and the command line swaps it
(``model=mlp``). Each group owns some top-level sections of the schema (``GROUPS``); an option that sets anything
else is refused, so swapping a model can never change, say, the launch.

Where options are found, first match wins: ``configs/`` in the recipe's folder, then ``configs/`` beside the recipe's
folder (``recipes/../configs``: a clone's layout, or a project's own), then the ``configs/`` shipped inside the
package (the top-level ``configs/`` of the source tree, installed as package data), so an installed package resolves
``model: tiny_gpt`` for a recipe written anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

#: Group name -> the top-level recipe keys its options may set.
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model",),
    "data": ("data",),
    "trainer": ("trainer",),
    "ft": ("ft",),
    "launch": ("launch",),
}

#: The configs shipped with the package (a link to the source tree's top-level ``configs/`` in a checkout).
PACKAGED = Path(__file__).resolve().parents[1] / "configs"


#: What an option may be called: a file name in its group's folder (no separator, no leading dot: no ``..``).
_OPTION_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


class GroupError(ValueError):
    """An unknown group or option; the message lists what exists."""


def search_path(recipe: Path | None) -> list[Path]:
    """The folders searched for ``GROUP/OPTION.yaml`` for ``recipe``, in order, each once; no recipe: ``configs/``
    in the current folder, then the package's."""
    candidates = ([recipe.parent / "configs", recipe.parent.parent / "configs", PACKAGED] if recipe is not None
                  else [Path.cwd() / "configs", PACKAGED])
    found: list[Path] = []
    for folder in candidates:
        if folder.is_dir() and folder.resolve() not in [f.resolve() for f in found]:
            found.append(folder)
    return found


def check_group(group: str) -> None:
    if group not in GROUPS:
        raise GroupError(f"unknown config group {group!r}; groups: {', '.join(sorted(GROUPS))}")


def options(group: str, folders: list[Path]) -> list[str]:
    """Every option of ``group`` in ``folders``, sorted."""
    return sorted({p.stem for folder in folders for p in (folder / group).glob("*.yaml")})


def option_file(group: str, option: str, folders: list[Path]) -> Path:
    """The file of ``group=option``: the first one on the search path. An option is a name, never a path: a choice
    reaches only the files of its group's folders."""
    check_group(group)
    name = option.removesuffix(".yaml")
    if not _OPTION_NAME.fullmatch(name):
        known = ", ".join(options(group, folders)) or "(none)"
        raise GroupError(f"config group {group!r}: option {option!r} is not a name (letters, digits, '_', '-', '.', "
                         f"not starting with '.'): an option is a file GROUP/OPTION.yaml of a configs/ folder; "
                         f"options: {known}")
    for folder in folders:
        candidate = folder / group / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    where = ", ".join(str(f / group) for f in folders) or "no configs/ folder found"
    known = options(group, folders)
    raise GroupError(f"config group {group!r} has no option {option!r}; options: "
                     f"{', '.join(known) if known else '(none)'} (searched {where})")


def check_owned(group: str, keys: list[str], source: Path) -> None:
    """Refuse an option of ``group`` that sets top-level keys the group does not own."""
    foreign = [k for k in keys if k not in GROUPS[group]]
    if foreign:
        raise GroupError(f"{source} (an option of group {group!r}) sets {', '.join(foreign)}: a {group} option may "
                         f"set only {', '.join(GROUPS[group])}; move the rest to the recipe or to its own group")
