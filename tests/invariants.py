"""The run invariants (now in ``lightning_fthsdp.launch.invariants``, where the chaos soak uses them too)."""

from lightning_fthsdp.launch.invariants import (
    assert_consistent,
    assert_exactly_once,
    assert_no_regression,
    assert_no_step_lost,
    contributions_by_step,
    kept_commits,
)

__all__ = ["assert_consistent", "assert_exactly_once", "assert_no_regression", "assert_no_step_lost",
           "contributions_by_step", "kept_commits"]
