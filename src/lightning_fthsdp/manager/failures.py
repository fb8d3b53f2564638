"""How many commits of one replica group failed in a row, and the budget that ends the retries: a cause no retry
fixes (a lighthouse never reachable, a group that never catches up) stops the job, naming it, instead of retrying
for ever."""

from __future__ import annotations


class CommitsFailed(RuntimeError):
    """``Timeouts.max_failed_commits`` commits in a row failed: training cannot make progress."""


class FailedCommits:
    """The failed commits in a row of group ``replica_id``, at most ``budget`` (``Timeouts.max_failed_commits``).
    Every rank of the group counts the same commits (the outcomes of the group's vote), so all raise alike."""

    def __init__(self, replica_id: str, budget: int) -> None:
        self._replica_id, self._budget = replica_id, budget
        self._in_a_row = 0

    def count(self, cause: str) -> None:
        """One more failed commit, for ``cause``; raises CommitsFailed, naming it, once the budget is spent."""
        self._in_a_row += 1
        if self._in_a_row >= self._budget:
            raise CommitsFailed(
                f"FTManager (group {self._replica_id}): {self._in_a_row} commits in a row failed "
                f"(Timeouts.max_failed_commits={self._budget}); the last cause: {cause}. Fix that cause, or raise "
                f"max_failed_commits (recipe: ft.timeouts.max_failed_commits) to keep retrying longer")

    def reset(self) -> None:
        """The group made progress: a commit, or a step followed during a catch-up."""
        self._in_a_row = 0
