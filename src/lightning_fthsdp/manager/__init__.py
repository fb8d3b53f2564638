"""The per-rank manager: one fault-tolerant step (quorum, exchange, commit vote, catch-up) in order."""

from lightning_fthsdp.manager.manager import FTManager

__all__ = ["FTManager"]
