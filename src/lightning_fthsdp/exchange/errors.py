"""How a cross-group collective fails: abandoned (the step is retried) or impossible here (no retry helps)."""

from __future__ import annotations


class CollectiveAborted(RuntimeError):
    """The collective was abandoned: a member died, hung, or the lighthouse announced a new membership."""


class CrossGroupConfigError(ValueError):
    """The cross-group process group cannot be built in this configuration: retrying cannot help."""
