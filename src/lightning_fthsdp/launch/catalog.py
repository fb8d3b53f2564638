"""``fthsdp recipes``: the recipes and example scripts shipped with the package, and where a recipe or script named
by a path that is not a file is found.

The wheel carries the source tree's ``recipes/*.yaml`` and ``examples/*.py`` as package data under
``lightning_fthsdp/shipped/`` (in a checkout, links to those folders), so a ``pip install`` user has the files the
README names: where ``recipes/tiny_gpt.yaml`` (or ``tiny_gpt.yaml``, ``tiny_gpt``) is not a file here, the shipped
recipe of that name is used, and so is the shipped example for ``--script examples/train_accelerate.py``. Only a bare
name or one under ``recipes/`` (``examples/``) is looked up: a mistyped path of the user's own is an error, never
silently replaced by a shipped file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "shipped"


@dataclass(frozen=True)
class Shelf:
    """One kind of shipped file: its folder and how a name of it is written."""

    folder: str
    suffix: str
    use: str
    """How a file of it is run, for the listing."""

    @property
    def path(self) -> Path:
        return SHIPPED / self.folder

    def files(self) -> list[Path]:
        return sorted(self.path.glob(f"*{self.suffix}"))

    def find(self, given: Path, what: str) -> Path:
        """``given`` if it is a file; else the shipped file it names (a bare name, or one under ``folder/``, with or
        without the suffix), said on stderr (stdout may be a printed config). ValueError naming ``what``, the value
        and the shipped files when neither exists."""
        if given.is_file():
            return given
        parent = given.parent.as_posix()
        name = given.name if given.name.endswith(self.suffix) else given.name + self.suffix
        if parent in (".", self.folder) and (self.path / name).is_file():
            print(f"{what} {given}: no such file here; using the shipped {self.path / name}", file=sys.stderr)
            return self.path / name
        shipped = ", ".join(p.name for p in self.files()) or "(none)"
        raise ValueError(f"{what} {given}: no such file here, nor a shipped one of that name (shipped: {shipped}, "
                         f"`fthsdp recipes` lists them): give the path of an existing file")


RECIPES = Shelf("recipes", ".yaml", "fthsdp launch NAME.yaml [group=option key=value ...]")
EXAMPLES = Shelf("examples", ".py", "fthsdp launch --script NAME.py [--replicas R ...] [-- SCRIPT ARGS]")


def recipe_path(given: Path) -> Path:
    """The recipe file ``given`` names (see ``Shelf.find``)."""
    return RECIPES.find(given, "recipe")


def script_path(given: Path) -> Path:
    """The script ``--script given`` names (see ``Shelf.find``)."""
    return EXAMPLES.find(given, "--script")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "recipes", help="list the recipes and example scripts shipped with the package, or print one",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=None, metavar="NAME",
                        help="print this shipped recipe or example (e.g. tiny_gpt.yaml, train_accelerate.py) to copy "
                             "and edit it: fthsdp recipes tiny_gpt.yaml > my_recipe.yaml")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name is not None:
        for shelf in (RECIPES, EXAMPLES):
            path = shelf.path / args.name
            if args.name.endswith(shelf.suffix) and path.parent == shelf.path and path.is_file():
                sys.stdout.write(path.read_text())
                return 0
        names = ", ".join(p.name for shelf in (RECIPES, EXAMPLES) for p in shelf.files())
        raise SystemExit(f"fthsdp recipes: error: no shipped recipe or example {args.name!r}; shipped: {names}")
    for shelf in (RECIPES, EXAMPLES):
        files = shelf.files()
        width = max((len(p.name) for p in files), default=0)
        print(f"{shelf.folder} in {shelf.path.resolve()} ({shelf.use}):")
        for path in files:
            print(f"  {path.name:<{width}}  {_summary(path)}")
    return 0


def _summary(path: Path) -> str:
    """The first line of a recipe's leading comment or of a script's docstring."""
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""
    first = text.splitlines()[0] if text else ""
    return first.lstrip("#").strip() if first.startswith("#") else ""
