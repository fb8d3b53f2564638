"""The console view renders in both modes (rich live table, plain lines) from the supervisor's group states."""

from __future__ import annotations

import pytest

from lightning_fthsdp.launch.supervisor import GroupState
from lightning_fthsdp.launch.view import ConsoleView


def _groups() -> dict[str, GroupState]:
    return {"a": GroupState("a", status="training", step=12, loss=2.5, participants=["a"]),
            "b": GroupState("b", status="down", step=9, restarts=1)}


def test_plain_mode_prints_events_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    view = ConsoleView(replicas=2, max_steps=50, live=False)
    view.event("inject kill on group b")
    view.update(_groups())
    view.close()
    out = capsys.readouterr().out
    assert "inject kill on group b" in out
    assert "step 12/50  quorum 1/2 (a)  loss 2.5000  [a:training@12 b:down@9]" in out


def test_live_mode_renders_a_table_with_every_group() -> None:
    from rich.console import Console

    view = ConsoleView(replicas=2, max_steps=50, live=False)  # render the table without starting a Live display
    view.event("inject kill on group b")
    console = Console(width=120, record=True)
    console.print(view.render(_groups()))
    text = console.export_text()
    assert "quorum 1/2 (a)" in text and "inject kill on group b" in text
    assert "training" in text and "down" in text
