"""The ``fthsdp`` command: one sub-command per module, each module adds its own parser.

Sub-command modules are imported only to build their parser; heavy imports (torch, matplotlib) belong inside
their ``run`` functions so ``fthsdp --help`` stays fast, and so that the base install (no extras) runs every
command that needs none: ``lighthouse``, ``simulate --closed-form``, ``demo``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_fthsdp.config.version import VERSION

# Each module defines ``add_parser(subparsers) -> None``; the parser it adds sets ``func(args) -> int`` and, for a
# command that needs optional extras, ``extras`` (their names in pyproject.toml): an install without one gets the pip
# line that installs them all instead of a traceback.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "lightning_fthsdp.lighthouse.cli",
    "lightning_fthsdp.demo.cli",
    "lightning_fthsdp.sim.cli",
    "lightning_fthsdp.launch.cli",
    "lightning_fthsdp.launch.fit",
    "lightning_fthsdp.slurm.cli",
    "lightning_fthsdp.k8s.cli",
    "lightning_fthsdp.launch.catalog",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fthsdp",
        description="Fault Tolerant HSDP: lighthouse, launcher, simulator and tools.",
    )
    parser.add_argument("--version", action="version", version=f"fthsdp (lightning-fthsdp) {VERSION}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, leftover = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option: overrides given after one (``R.yaml --replicas 2
    # model=mlp``) still belong to a command that takes overrides.
    stray = [t for t in leftover if t.startswith("-") or "=" not in t or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if leftover:
        args.overrides = [*args.overrides, *leftover]
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as err:  # a command whose optional dependencies the base install lacks
        from lightning_fthsdp.config import extras  # only now: reading metadata would slow every group's start

        extra = extras.providing(err.name or "")
        if extra is None:
            raise
        needs = (*getattr(args, "extras", ()), extra)
        raise SystemExit(extras.install_hint(f"fthsdp {args.command}", needs, [err.name or ""])) from None


if __name__ == "__main__":
    sys.exit(main())
