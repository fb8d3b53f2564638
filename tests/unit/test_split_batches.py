"""How FTManager splits a constant global batch over the groups that contribute (``split_batches``)."""

from __future__ import annotations

import pytest

from lightning_fthsdp.manager import FTManager, split_batches


def test_without_a_global_batch_every_participant_trains_one() -> None:
    assert split_batches(("a", "b", "c"), None) == {"a": 1, "b": 1, "c": 1}


def test_the_global_batch_is_split_as_evenly_as_possible_lowest_ids_first() -> None:
    assert split_batches(("a", "c"), 3) == {"a": 2, "c": 1}
    assert split_batches(("b",), 4) == {"b": 4}
    assert split_batches(("a", "b", "c"), 8) == {"a": 3, "b": 3, "c": 2}


def test_more_participants_than_batches_each_train_one() -> None:
    assert split_batches(("a", "b", "c"), 2) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
def test_bad_global_batches_is_refused_with_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match=f"global_batches must be an integer >= 1.*got {bad!r}"):
        FTManager(replica_id="a", lighthouse="http://127.0.0.1:1", global_batches=bad)  # type: ignore[arg-type]
