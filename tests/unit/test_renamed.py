"""Names renamed for one name per concept: the old spelling still works until 0.3, with a deprecation."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from lightning_fthsdp.manager import FTManager

UNREACHABLE = "http://127.0.0.1:1"  # FTManager connects at the first step only


@pytest.fixture
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_ftmanager_group_is_read_as_process_group(one_rank_group: dist.ProcessGroup) -> None:
    with pytest.warns(FutureWarning, match=r"FTManager\(group=\) is deprecated, use process_group="):
        manager = FTManager(replica_id="a", lighthouse=UNREACHABLE, group=one_rank_group)
    same = FTManager(replica_id="a", lighthouse=UNREACHABLE, process_group=one_rank_group)
    try:
        assert (manager.rank, manager.shard_count) == (0, 1)
        assert (same.rank, same.shard_count) == (0, 1)
    finally:  # each serves catch-up snapshots on a socket of its own
        manager.shutdown()
        same.shutdown()


def test_ftmanager_refuses_two_different_process_groups(one_rank_group: dist.ProcessGroup) -> None:
    other = dist.new_group([0], backend="gloo")
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"FTManager got process_group=.* and group=.* "
                                                                     r"\(its deprecated old name\): pass only"):
        FTManager(replica_id="a", lighthouse=UNREACHABLE, process_group=one_rank_group, group=other)


def test_ftmanager_state_host_is_read_as_advertise_host() -> None:
    with pytest.warns(FutureWarning, match=r"FTManager\(state_host=\) is deprecated, use advertise_host="):
        manager = FTManager(replica_id="a", lighthouse=UNREACHABLE, state_host="127.0.0.2")
    try:
        assert manager.advertise_host == "127.0.0.2"
    finally:
        manager.shutdown()
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"FTManager got advertise_host='127.0.0.3' and "
                                                                     r"state_host='127.0.0.2'.*pass only advertise"):
        FTManager(replica_id="a", lighthouse=UNREACHABLE, advertise_host="127.0.0.3", state_host="127.0.0.2")


def test_ftmanager_recoveries_is_the_catch_up_log() -> None:
    manager = FTManager(replica_id="a", lighthouse=UNREACHABLE)
    try:
        manager.catch_up_log.append({"source": "b", "step": 3})
        with pytest.warns(FutureWarning, match="FTManager.recoveries is deprecated, use catch_up_log"):
            assert manager.recoveries == [{"source": "b", "step": 3}]
    finally:
        manager.shutdown()


def test_the_old_core_import_paths_still_work_with_a_deprecation() -> None:
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from lightning_fthsdp.core.manager import FTManager\n"
            "from lightning_fthsdp.core.torch_state import ModuleState\n"
            "from lightning_fthsdp.core.config import Timeouts\n"
            "from lightning_fthsdp import manager, recovery, config\n"
            "import lightning_fthsdp.recovery.torch_state, lightning_fthsdp.config.timeouts\n"
            "assert FTManager is manager.FTManager and ModuleState is recovery.torch_state.ModuleState\n"
            "assert Timeouts is config.timeouts.Timeouts\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lightning_fthsdp.core is deprecated" in done.stderr
