"""An ``FTManager`` (or its group quorum) refused late in its construction leaves nothing open in a process that
goes on."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

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


class Agreement:
    """A multi-rank group's leader side of ``GroupAgreement``, whose exchange over the group's link fails at
    ``fails_at`` (``from_leader``, or ``gather_addresses`` after it)."""

    is_leader, rank, size = True, 0, 2

    def __init__(self, fails_at: str) -> None:
        self.fails_at = fails_at

    def from_leader(self, address: str) -> str:
        if self.fails_at == "from_leader":
            raise RuntimeError("the group's link broke")
        return address

    def on_link_broken(self, callback: object) -> None:
        pass

    def gather_addresses(self, address: str) -> list[str]:
        raise RuntimeError("the group's link broke")


@pytest.mark.parametrize("fails_at", ["from_leader", "gather_addresses"])
def test_a_group_quorum_whose_construction_fails_closes_the_relay_it_opened(fails_at: str) -> None:
    """The leader of a multi-rank group opens its relay (a listening socket for its ranks' heartbeats) first; a
    failure in the construction after it closes it again."""
    from lightning_fthsdp.config.timeouts import Timeouts
    from lightning_fthsdp.manager.group_quorum import GroupQuorum

    listening, threads = _listening(), set(threading.enumerate())
    comm = SimpleNamespace(prepare=lambda *args: None)
    catchup = SimpleNamespace(address="http://127.0.0.1:9", serve=lambda step: None)
    with pytest.raises(RuntimeError, match="the group's link broke") as raised:
        GroupQuorum("http://127.0.0.1:9", None, "127.0.0.1", Timeouts(), Agreement(fails_at), comm, catchup,  # type: ignore[arg-type]
                    replica_id="a", incarnation="i", step=lambda: 0)
    # Checked while the error (and the frames it holds) lives, as a caller handling it would: the socket must be
    # closed, not merely left for the garbage collector.
    assert raised.value is not None and _listening() == listening
    assert [t for t in threading.enumerate() if t not in threads and t.is_alive()] == []
