"""The exchange started during backward (``manager.overlap``) against the one after it, on real processes with a real
lighthouse: the same job trains bit-identical parameters either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Job
from lightning_fthsdp.testing.invariants import assert_consistent, assert_no_step_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 12


def train(workdir: Path, extra: tuple[str, ...]) -> list[str]:
    """Two groups that both take part in every step (``min_replicas=2``); each step's parameter digest."""
    workdir.mkdir()
    job = Job(workdir, min_replicas=2)
    try:
        job.start_lighthouse()
        a, b = (job.start_group(replica_id, STEPS, step_time_ms=0, extra=extra) for replica_id in ("a", "b"))
        for group in (a, b):
            assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
        assert_consistent(a, b)
        assert_no_step_lost(a, STEPS)
        assert all(r["participants"] == 2 for r in a.records())
        return [r["params_sha256"] for r in a.records()]
    finally:
        job.close()


def test_overlapped_and_after_backward_exchanges_train_identical_parameters(tmp_path: Path) -> None:
    # 1 KiB buckets: the demo model's last layers' go out while backward still runs.
    overlapped = train(tmp_path / "overlapped", ("--bucket-kib", "1"))
    after = train(tmp_path / "after", ("--bucket-kib", "1", "--no-overlap"))
    assert len(overlapped) == STEPS and overlapped == after
