"""The validation slice of a recipe's data: fixed, the same in every process, and never trained on."""

from __future__ import annotations

from typing import TypeVar

from torch.utils.data import Dataset, Subset

T = TypeVar("T")


def held_out(dataset: Dataset[T], count: int, name: str) -> tuple[Subset[T], Subset[T]]:
    """(training part, the last ``count`` items): a fixed validation slice that no replica group trains on."""
    size = len(dataset)  # type: ignore[arg-type]
    if not 0 < count < size:
        raise ValueError(f"{name}={count} must hold out at least one item and leave one to train on: the data has "
                         f"{size}; choose {name} between 1 and {size - 1}")
    return Subset(dataset, range(size - count)), Subset(dataset, range(size - count, size))
