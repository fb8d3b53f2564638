"""An ``FTManager`` refused for bad input late in its construction leaves nothing open in a process that goes on."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest

from lightning_fthsdp.exchange.reaper import REAPER
from lightning_fthsdp.manager.manager import FTManager


def _listening() -> set[tuple[str, int]]:
    return {tuple(c.laddr) for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_a_bad_checkpoint_setting_leaves_no_server_socket_or_thread_behind(tmp_path: Path) -> None:
    """The checkpoint settings are checked after the state server started listening: it is closed again."""
    REAPER.start()  # one thread per process, kept for every manager of it (exchange.reaper)
    listening, threads = _listening(), set(threading.enumerate())
    with pytest.raises(ValueError, match=r"checkpoint_every_n_steps must be an integer >= 0.*got -1"):
        FTManager(replica_id="a", lighthouse="http://127.0.0.1:9", checkpoint_dir=str(tmp_path),
                  checkpoint_every_n_steps=-1)
    assert _listening() == listening
    assert [t for t in threading.enumerate() if t not in threads and t.is_alive()] == []
