"""The chaos soak's short profile: three plain groups and a real lighthouse for about 2 minutes of seeded random
failures (SIGKILL and SIGSTOP at every phase, the source killed while serving, the recovering group killed while
fetching, following or replaying, two groups at once, the lighthouse killed during a membership change, restarts
killed while starting); the run's invariants hold throughout. ``bench/bench_soak.py`` runs the long one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.testing.soak import Soak, SoakConfig
from lightning_fthsdp.testing.soak_report import format_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    config = SoakConfig(duration_s=115, seed=2, mean_gap_s=2.5, ballast_mib=32)
    result = Soak(tmp_path, config).run()
    table = format_table(result)
    print(table)
    assert not result["findings"], table
    assert result["settled"], table
    assert result["lost_steps"] == [], table
    assert result["invariant_checks"] >= 5, table
    # The run did what it is for: many failures of several kinds, restarts that came back and trained.
    assert result["failures"] >= 15, table
    assert len({kind.split(" (")[0] for kind in result["failures_by_kind"]}) >= 6, table
    assert result["recovery_s"]["kill_to_commit"]["n"] >= 3, table
    # A group recovering never stalls the healthy ones beyond what a failure does (the heartbeat timeout, 1 s).
    assert result["stall_s"]["recovering"]["max"] < config.heartbeat_timeout_ms / 1000, table
