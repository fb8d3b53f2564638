from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.faults import PHASES, Fault, FaultFile


def test_every_phase_parses_and_round_trips() -> None:
    for phase in PHASES:
        fault = Fault.parse(f"sigstop:step=3:phase={phase}")
        assert Fault.parse(str(fault)) == fault
        assert fault.due(3, phase, 0) and not fault.due(2, phase, 0) and not fault.due(3, phase, 1)


def test_a_timed_stop_round_trips_with_its_duration() -> None:
    fault = Fault.parse("sigstop:step=3:phase=allreduce:for=2.5")
    assert str(fault).endswith(":for=2.5") and Fault.parse(str(fault)) == fault


def test_unknown_phase_names_the_phases() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        Fault.parse("sigkill:step=1:phase=lunch")


def test_fault_file_arms_and_disarms(tmp_path: Path) -> None:
    path = tmp_path / "fault"
    faults = FaultFile(path)
    assert faults.poll() == (False, None)
    path.write_text("sigkill:step=5:phase=commit")
    changed, fault = faults.poll()
    assert changed and fault == Fault("sigkill", 5, "commit")
    assert faults.poll() == (False, None), "unchanged: keep what was armed"
    tmp = tmp_path / "fault.tmp"
    tmp.write_text("")
    tmp.replace(path)
    assert faults.poll() == (True, None)
    path.unlink()
    assert faults.poll() == (True, None), "a removed file disarms too"
    assert faults.poll() == (False, None)
