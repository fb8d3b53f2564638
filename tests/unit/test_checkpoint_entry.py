"""The fault-tolerant state a Lightning checkpoint carries (``lightning.checkpoint_entry``): what the writing group
puts in is what every group resuming from it reads back, and a checkpoint another strategy wrote is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from lightning_fthsdp.lightning.checkpoint_entry import KEY, read_entry, write_entry
from lightning_fthsdp.manager import FTManager


def manager(step: int, batches: dict[str, int]) -> FTManager:
    return cast(FTManager, SimpleNamespace(replica_id="a", step=step, batches_committed=batches))


def test_every_group_resumes_at_the_writers_step_and_each_groups_own_position() -> None:
    checkpoint: dict[str, Any] = {"state_dict": {}}
    write_entry(checkpoint, manager(7, {"a": 7, "b": 5}))
    assert checkpoint[KEY]["writer"] == "a"
    resuming = manager(0, {})
    read_entry(checkpoint, "epoch=0-step=7.ckpt", resuming)
    assert (resuming.step, resuming.batches_committed) == (7, {"a": 7, "b": 5})


def test_a_checkpoint_another_strategy_wrote_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"cannot resume from other\.ckpt: it was not written by FTHSDPStrategy"):
        read_entry({"state_dict": {}}, "other.ckpt", manager(0, {}))
