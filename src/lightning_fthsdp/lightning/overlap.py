"""When FTHSDPStrategy starts the exchange while Lightning's backward runs (``manager.overlap``).

Only where the gradients backward produces are the ones the optimizer step exchanges: automatic optimization (manual
steps call backward where and as often as they like), the micro-batch an optimizer step follows (accumulation adds
more after the others), and no ``on_after_backward`` of the module's or a callback's (it may edit the gradients after
their buckets were sent). Never for the batches the strategy trains itself (extra ones, a step trained again after a
checkpoint load): Lightning's loop state there is the outer step's, so the strategy leaves them out itself.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_fthsdp.lightning import private


def exchange_during_backward(trainer: pl.Trainer) -> bool:
    """Whether the backward now due may start the step's exchange."""
    module = trainer.lightning_module
    if not module.automatic_optimization or private.is_accumulating(trainer):
        return False
    if is_overridden("on_after_backward", module, parent=pl.LightningModule):
        return False
    return not any(is_overridden("on_after_backward", callback, parent=pl.Callback) for callback in trainer.callbacks)
