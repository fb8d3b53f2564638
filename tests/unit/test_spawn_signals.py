"""A scheduler's SIGTERM can land while the launcher starts a process: that process must still be ended by the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Job


class _Terminated(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def test_a_sigterm_landing_just_after_the_fork_leaves_the_process_recorded_and_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        os.kill(os.getpid(), signal.SIGTERM)  # a raising handler would run at the next bytecode, before the record
        return started[-1]

    previous = signal.signal(signal.SIGTERM, _raise)
    job = Job(tmp_path)
    try:
        monkeypatch.setattr(subprocess, "Popen", popen_then_sigterm)
        with pytest.raises(_Terminated):
            job.start_command("a", [sys.executable, "-c", "import time; time.sleep(120)"],
                              jsonl=tmp_path / "a.jsonl", log=tmp_path / "a.log")
        monkeypatch.undo()
        assert len(started) == 1 and started[0].poll() is None
    finally:
        job.close()
        signal.signal(signal.SIGTERM, previous)
    assert started[0].poll() == -signal.SIGKILL, "the job's close() did not end the process started as SIGTERM came"
