"""The exchange started while backward runs: each bucket of a step's gradients starts as soon as backward has produced
all of them, so the cross-group transfer hides under the rest of backward instead of following it.

The step's tensors are exchanged in reverse parameter order (``manager.gradients``), the order backward produces
them. A parameter's gradient is final when its post-accumulate-grad hook fires: autograd fires it once the gradient of
a backward is accumulated, and FSDP2 fires it on the sharded parameter once the reduce-scatter's shard is in place
(FSDP's own post-backward), so the same hook serves plain modules and sharded ones. Buckets start in order
(``average.BucketedSum``): a parameter without a gradient this step holds the buckets after it back until the
exchange finishes after backward, with zeros in its place, as every group does.

Like DDP, the gradients are sent as backward produces them: what changes a gradient after its backward (a second
backward in the same step, a hook editing gradients) is not what was sent. A gradient produced again after its bucket
started raises (a second backward in one step), and so does one changed in place after it (``BucketedSum.finish``):
front ends arm the overlap only where nothing else edits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from lightning_fthsdp.exchange.average import BucketedSum
from lightning_fthsdp.exchange.errors import CollectiveAborted
from lightning_fthsdp.recovery.torch_state import local


class OverlappedExchange:
    """Hooks on ``params`` that start an armed exchange's buckets as backward produces their gradients."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        count = len(self.params)
        self._position = {id(p): count - 1 - i for i, p in enumerate(self.params)}
        self._exchange: BucketedSum | None = None
        self._produced: list[torch.Tensor | None] = []
        self._known = 0  # positions before this one all produced
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]

    def arm(self, exchange: BucketedSum) -> None:
        """Start ``exchange``'s buckets during the next backward (until it finishes)."""
        self._exchange, self._produced, self._known = exchange, [None] * len(self.params), 0

    @property
    def armed(self) -> bool:
        """Whether an exchange is armed that has not finished."""
        return self._exchange is not None and not self._exchange.finished

    def disarm(self) -> None:
        """Forget the armed exchange and the gradients it was given (nothing of a step kept into the next)."""
        self._exchange, self._produced, self._known = None, [], 0

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.disarm()

    def _on_gradient(self, param: torch.Tensor) -> None:
        exchange = self._exchange
        if exchange is None or exchange.finished or exchange.failure is not None:
            return
        position = self._position[id(param)]
        if position < exchange.sent:
            raise RuntimeError(
                f"OverlappedExchange: parameter {position} of the exchange (counted from the last) got a gradient "
                f"again after it was sent to the other replica groups: backward ran twice in one step; run one "
                f"backward per micro-batch, or turn the overlapped exchange off (overlap_exchange=False)")
        assert param.grad is not None, "the hook fires once the gradient is accumulated"
        self._produced[position] = local(param.grad)
        while self._known < len(self._produced) and self._produced[self._known] is not None:
            self._known += 1
        if self._known > exchange.sent:
            try:
                exchange.start(cast(list[torch.Tensor], self._produced[:self._known]))  # all produced
            except CollectiveAborted as exc:  # the step fails where it would have without the overlap: in finish
                exchange.failure = exc
