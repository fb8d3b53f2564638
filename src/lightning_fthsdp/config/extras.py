"""The optional extras (``pip install 'lightning-fthsdp[EXTRA]'``) a command needs, read from the installed
distribution's own metadata, so that the answer is always what pyproject.toml declares."""

from __future__ import annotations

import importlib.metadata
import re

DISTRIBUTION = "lightning-fthsdp"

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def requirements() -> dict[str, list[str]]:
    """Extra -> the distributions it requires; empty when this package is not installed (a bare source tree has
    no metadata to read, and then nothing is checked)."""
    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    by_extra: dict[str, list[str]] = {}
    for requirement in declared:
        name, extra = _NAME.match(requirement), _EXTRA.search(requirement)
        if name and extra:
            by_extra.setdefault(extra.group(1), []).append(name.group(0))
    return by_extra


def missing(extras: tuple[str, ...]) -> list[str]:
    """The distributions of ``extras`` that are not installed."""
    wanted = requirements()
    return [name for extra in extras for name in wanted.get(extra, []) if not _installed(name)]


def providing(module: str) -> str | None:
    """The extra that requires the distribution named like ``module``'s top-level package, if one does."""
    top = _normalised(module.partition(".")[0])
    return next((extra for extra, names in requirements().items()
                 if any(_normalised(name) == top for name in names)), None)


def install_hint(command: str, needs: tuple[str, ...], absent: list[str]) -> str:
    """The line telling the user of ``command`` to install the extras ``needs`` (one pip line for all of them) since
    ``absent`` are not installed."""
    extras = ",".join(dict.fromkeys(needs))
    return (f"{command} needs the extras [{extras}] ({', '.join(absent)} not installed): "
            f"pip install '{DISTRIBUTION}[{extras}]'")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()
