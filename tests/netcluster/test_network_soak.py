"""The chaos soak on the emulated network: each group and the lighthouse on a host of its own, kills and hangs at
every phase mixed with network faults (a group cut off from the lighthouse, two groups cut off from each other, a slow
link, a flapping link), about 45 s of it; the run's invariants hold throughout. ``bench/bench_soak.py --network``
runs the long one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.testing.soak import Soak, SoakConfig
from lightning_fthsdp.testing.soak_report import format_table
from tests.netcluster.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_network_soak_keeps_every_invariant(tmp_path: Path, netcluster: ClusterFactory) -> None:
    # Each kind gets its first turn before any repeats and network faults weigh as much as kills at a random phase.
    config = SoakConfig(duration_s=45, seed=3, mean_gap_s=2.5, ballast_mib=8, network=True,
                        collective_timeout_ms=5_000, weights={"phase": 3.0, "cut_lighthouse": 3.0, "cut_peers": 3.0,
                                                              "slowlink": 2.0, "flap": 2.0})
    result = Soak(tmp_path, config).run()
    table = format_table(result)
    print(table)
    assert not result["findings"], table
    assert result["settled"] and result["lost_steps"] == [], table
    kinds = {kind.split(" (")[0] for kind in result["failures_by_kind"]}
    assert len({k for k in kinds if k.startswith("network")}) >= 3 and "network cut_peers" in kinds, table
    assert len(kinds) >= 6, table
    # Bounded stalls: a cut between two groups costs the others one failed exchange (the collective timeout), the
    # probe and a quorum (each within a heartbeat timeout); nothing else costs more.
    bound_s = (config.collective_timeout_ms + 3 * config.heartbeat_timeout_ms + config.join_timeout_ms) / 1000
    assert result["stall_s"]["network"]["n"] > 0 and result["stall_s"]["all"]["max"] < bound_s, table
