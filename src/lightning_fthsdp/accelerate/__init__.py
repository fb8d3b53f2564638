"""The Accelerate front end of FT-HSDP: ``FaultTolerantHSDP`` around an ordinary Accelerate training loop.

One Accelerate launch (or torchrun) per replica group: Accelerate's world is the group, FSDP2 inside it is
Accelerate's own (``FullyShardedDataParallelPlugin(fsdp_version=2)``), and the helper adds the fault-tolerant exchange
across groups, the commit vote, catch-up and each group's own data stream. Imports Accelerate; nothing below it
does. See docs/accelerate.md.
"""

from lightning_fthsdp.accelerate.helper import FaultTolerantHSDP

__all__ = ["FaultTolerantHSDP"]
