"""Deprecated: ``lightning_fthsdp.manager`` (until 0.3)."""

from lightning_fthsdp.manager import FTManager, QuorumUnavailable, split_batches

__all__ = ["FTManager", "QuorumUnavailable", "split_batches"]
