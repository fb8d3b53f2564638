"""The ``fthsdp`` command: one sub-command per module, each module adds its own parser.

Sub-command modules are imported only to build their parser; heavy imports (torch, matplotlib) belong inside
their ``run`` functions so ``fthsdp --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module defines ``add_parser(subparsers) -> None``; the parser it adds sets ``func(args) -> int``.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "lightning_fthsdp.lighthouse.cli",
    "lightning_fthsdp.demo.cli",
    "lightning_fthsdp.sim.cli",
    "lightning_fthsdp.launch.cli",
    "lightning_fthsdp.launch.fit",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fthsdp",
        description="Fault Tolerant HSDP: lighthouse, launcher, simulator and tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
