"""What a rank exchanges for one step's gradients, the same rule for every front end.

Every group must send the same tensors (gloo sizes must match): a parameter this rank has no gradient for is sent as
zeros, beside one flag per parameter saying whether the group had a gradient for it. After the exchange, a parameter
no contributing group had a gradient for gets none at all, so the optimizer skips it as it would without fault
tolerance, instead of stepping it with zeros (weight decay, momentum and Adam's moments would move it).
"""

from __future__ import annotations

import torch

from lightning_fthsdp.recovery.torch_state import local


class ExchangedGradients:
    """The gradients of ``params`` as one step exchanges them; ``device``: where the flags go (the gradients')."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self._params, self._device = params, device
        self._sent: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._own: list[float] | None = None  # per parameter: whether this rank had a gradient, as the step began
        self._had = torch.zeros(0)  # per parameter: > 0 once exchanged if a contributing group had a gradient

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to exchange: each parameter's gradient (this rank's shard; zeros put in where it has none), last
        parameter first (the order backward produces them: ``exchange.overlap``), then the flags. The same tensors
        carry the averages back (and a replayed step's, see ``drop_missing``). Every attempt of one step sends the
        flags of the first: a retry finds the zeros put in."""
        if self._own is None:
            self._own = [float(p.grad is not None) for p in self._params]
        self._had = torch.tensor(self._own, device=self._device)
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sent = [(p, p.grad) for p in self._params]
        return [local(p.grad) for p in reversed(self._params)] + [self._had]

    def drop_missing(self) -> None:
        """After the exchange: no gradient (None) for a parameter no contributing group had one for. The exchanged
        tensor is attached again otherwise (a replayed step before this one may have dropped it)."""
        for (p, grad), had in zip(self._sent, self._had.tolist(), strict=True):
            wanted = grad if had > 0.0 else None
            if p.grad is not wanted:  # assigning a DTensor's gradient validates it: only where it changes
                p.grad = wanted
