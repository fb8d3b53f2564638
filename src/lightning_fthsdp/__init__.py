"""lightning-fthsdp: Fault Tolerant Hybrid-Sharded Data Parallelism for PyTorch.

The fault-tolerant core (``lightning_fthsdp.core``) imports nothing of Lightning; front ends live beside it.
"""

from __future__ import annotations

__version__ = "0.1.0"
