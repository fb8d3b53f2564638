"""The command line's override grammar, Hydra's: one ``Override`` per argument, and the sweeps ``-m`` expands.

``key=value`` sets a key the config has; ``+key=value`` adds one it does not have (refused where it has a value);
``++key=value`` adds or sets; ``~key`` (or ``~key=value``: only while the value is that) removes what the recipe set,
so the key falls back to the schema's default. The same prefixes on a config group edit the defaults list:
``group=option`` replaces the choice the tree made (refused for a group it never names), ``+group=option`` appends
a group the tree does not name, ``~group[=option]`` drops it; ``group@package=option`` places the option's keys
under ``package``. A value is YAML (quote it, Hydra's way, to keep a comma or a colon: ``key='a,b'``; ``[1,2]`` is a
list); a group's option is a YAML string (``trainer='gpu'`` is ``trainer=gpu``), one per group (``trainer=[gpu,cpu]``
is refused). A value with top-level commas is a sweep
(``model=mlp,tiny_gpt``), which only ``fthsdp launch -m`` expands, one job per combination. Hydra syntax beyond
this (its sweep functions, its own ``hydra.*`` settings, package renames, nested groups) is refused as not
supported.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from lightning_fthsdp.recipes import groups


class OverrideError(ValueError):
    """An override that does not parse, or Hydra syntax this grammar does not support; the message says which."""


#: Hydra's sweep and cast functions (``range(1,4)``, ``choice(a,b)``, ``glob(*)``...): refused, not read as text.
_FUNCTIONS = ("range", "choice", "interval", "glob", "tag", "sort", "shuffle", "extend_list", "int", "float", "str",
              "bool", "json_str")
_FUNCTION_CALL = re.compile(rf"\s*({'|'.join(_FUNCTIONS)})\s*\(.*\)\s*", re.DOTALL)
_KEY = re.compile(r"[A-Za-z_][\w\-]*(\.[\w\-]+)*")
_PACKAGE = re.compile(r"_global_|_group_|[A-Za-z_][\w\-]*(\.[\w\-]+)*")
_PREFIXES = ("++", "+", "~")


@dataclass(frozen=True)
class Override:
    """One command-line override, parsed; ``values``: the raw YAML texts, several for a sweep, none for ``~key``."""

    text: str
    prefix: str
    """"" (set or choose), "+" (add), "++" (add or set), "~" (delete)."""
    key: str
    """A config group's name or a dotted key."""
    package: str | None
    """``group@package``: where the option's keys go; None: where the option's own file puts them."""
    values: tuple[str, ...]

    @property
    def is_group(self) -> bool:
        return self.key in groups.GROUPS

    @property
    def is_sweep(self) -> bool:
        return len(self.values) > 1

    @property
    def value(self) -> str | None:
        """The one value (None for ``~key`` without one); a sweep has none until ``expand`` picks."""
        if self.is_sweep:
            raise OverrideError(sweep_refusal(self))
        return self.values[0] if self.values else None

    @property
    def option(self) -> str | None:
        """A group override's option, read as YAML as Hydra reads it (``'gpu'`` is ``gpu``; ``null``: no option, as
        is ``~group`` without one); several options (``[gpu,cpu]``, ``{a: b}``) are refused."""
        value = self.value
        if value is None:
            return None
        try:
            option = yaml.safe_load(value)
        except yaml.YAMLError:
            return value.strip()  # not YAML: the option's name as written, which the group's folder then judges
        if isinstance(option, (list, dict)):
            raise OverrideError(f"{self.describe()}: several options of one group are not supported: choose one "
                                f"({self.key}=OPTION), or run one job per option with fthsdp launch -m "
                                f"{self.key}=A,B")
        return None if option is None else option if isinstance(option, str) else value.strip()

    def describe(self) -> str:
        return f"override {self.text!r}"


def parse(text: str) -> Override:
    """One argument as an ``Override``; ``OverrideError`` names what is wrong or not supported."""
    prefix = next((p for p in _PREFIXES if text.startswith(p)), "")
    body = text[len(prefix):]
    name, sep, raw = body.partition("=")
    if (not sep and prefix != "~") or not name:
        raise OverrideError(f"override {text!r} is neither group=option (e.g. model=mlp) nor key=value "
                            "(e.g. trainer.max_steps=50)")
    name = name.strip()
    if name == "hydra" or name.startswith(("hydra.", "hydra/")):
        raise OverrideError(f"override {text!r}: Hydra's own settings (hydra.*, hydra/launcher=...) are not "
                            "supported: fthsdp composes recipes without Hydra's runtime; the run folder is --out "
                            "and a sweep runs with fthsdp launch -m")
    key, at, package = name.partition("@")
    if "/" in key:
        raise OverrideError(f"override {text!r}: nested config groups ({key}) are not supported; groups: "
                            f"{', '.join(sorted(groups.GROUPS))}")
    if at:
        if ":" in package:
            raise OverrideError(f"override {text!r}: renaming a package (group@from:to) is not supported: name the "
                                "package the option goes to, group@package=option")
        if key not in groups.GROUPS:
            raise OverrideError(f"override {text!r}: only a config group takes @package, and {key!r} is none; "
                                f"groups: {', '.join(sorted(groups.GROUPS))}")
        if not _PACKAGE.fullmatch(package):
            raise OverrideError(f"override {text!r}: package {package!r} is not _global_, _group_ or a dotted key")
    if not _KEY.fullmatch(key):
        raise OverrideError(f"override {text!r}: {key!r} is not a key (letters, digits, '_', '-', dots between "
                            "names)")
    if prefix == "++" and key in groups.GROUPS:
        raise OverrideError(f"override {text!r}: force-add of a config group (++{key}=...) is not supported (nor is "
                            f"it in Hydra): choose with {key}=OPTION, or append with +{key}=OPTION")
    values = tuple(split_sweep(raw)) if sep else ()
    for value in values:
        if _FUNCTION_CALL.fullmatch(value):
            raise OverrideError(f"override {text!r}: Hydra's sweep and cast functions ({value.strip()}) are not "
                                "supported: list the values, key=a,b,c, with fthsdp launch -m")
    return Override(text, prefix, key, package or None, values)


def split_sweep(raw: str) -> list[str]:
    """The values of a sweep: split at commas outside quotes, brackets and braces; one value when there is none."""
    values, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(raw):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(raw[start:i])
            start = i + 1
    values.append(raw[start:])
    return values


def expand(texts: Sequence[str]) -> list[list[str]]:
    """The jobs of a sweep: one list of overrides per combination of the sweeps' values, the last sweep varying
    fastest (Hydra's order); one job, the overrides unchanged, when none sweeps."""
    parsed = [parse(text) for text in texts]
    choices = [[o.text] if not o.is_sweep else [_with_value(o, v) for v in o.values] for o in parsed]
    return [list(job) for job in itertools.product(*choices)]


def _with_value(override: Override, value: str) -> str:
    key = override.key + (f"@{override.package}" if override.package else "")
    return f"{override.prefix}{key}={value}"


def sweep_refusal(override: Override) -> str:
    """Why a sweep is refused outside ``-m``, and the ways on (Hydra's); a group takes one option, never a list."""
    sweep = (f"{override.describe()} has {len(override.values)} comma-separated values: a sweep runs one job per "
             f"value with fthsdp launch -m")
    if override.is_group:
        return f"{sweep}; without -m, choose one option ({override.key}={override.values[0]})"
    return (f"{sweep}; for one value that holds a comma, quote it ({override.key}='a,b'); for a list, bracket it "
            f"({override.key}=[a,b])")
