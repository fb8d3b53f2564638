"""Run ``fthsdp launch`` as a user would, in its own session, and always end it and what it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def run_launcher(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 240) -> tuple[int, str]:
    """(exit code, output) of ``cmd``; past ``timeout_s`` it gets SIGTERM (it then ends the groups it started),
    then SIGKILL for its whole process group."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                start_new_session=True, env=env)
    output = ""
    try:
        output, _ = launcher.communicate(timeout=timeout_s)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
    return launcher.returncode, output
