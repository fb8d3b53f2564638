"""Names renamed in 0.2 (one name per concept), still accepted until 0.3: one warning and one conflict rule for all."""

from __future__ import annotations

import warnings
from typing import TypeVar

T = TypeVar("T")


def deprecation(old: str, new: str, advice: str | None = None) -> str:
    """The one wording of every renamed name's warning: ``old`` still works, what to do instead, until when."""
    return f"{old} is deprecated, {advice or f'use {new}'} (the old name goes in 0.3)"


def renamed_argument(owner: str, new_name: str, new: T | None, old_name: str, old: T | None) -> T | None:
    """``new``, or the value passed under the old name with a FutureWarning pointed at the caller's caller; a
    ValueError when both are given and differ."""
    if old is None:
        return new
    warnings.warn(deprecation(f"{owner}({old_name}=)", f"{new_name}="), FutureWarning, stacklevel=3)
    if new is not None and new is not old and new != old:
        raise ValueError(f"{owner} got {new_name}={new!r} and {old_name}={old!r} (its deprecated old name): "
                         f"pass only {new_name}")
    return old
