"""AcceleratorGuards: three ``Accelerator`` methods as a fault-tolerant loop needs them, while ``FaultTolerantHSDP`` is
entered (instance attributes over the class's methods, removed on exit; the Accelerator is otherwise untouched).

- ``backward`` also keeps the loss, for the group's launch records, and first lets the helper start the exchange
  while it runs (``before_backward``);
- ``clip_grad_norm_`` with the helper's ``max_grad_norm`` returns the norm the helper measured when it clipped the
  averaged gradients (a step replayed after a catch-up must be clipped exactly like the trained one, so the helper
  clips both); with any other norm it raises, naming the fix;
- ``save_state`` writes in one replica group only (the others return None): every group holds the same state, and
  two groups writing one folder would interleave their files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator


class AcceleratorGuards:
    """Installs and removes the three guards on one Accelerator."""

    def __init__(self, accelerator: Accelerator, *, max_grad_norm: float | None, last_norm: Callable[[], Any],
                 writes_state: Callable[[], bool], before_backward: Callable[[], None]) -> None:
        self.accelerator = accelerator
        self.losses: list[torch.Tensor] = []
        """This step's micro-batch losses (detached), as given to ``backward``."""
        self._max_grad_norm = max_grad_norm
        self._last_norm = last_norm
        self._writes_state = writes_state
        self._before_backward = before_backward
        self._originals = {name: getattr(accelerator, name) for name in ("backward", "clip_grad_norm_", "save_state")}

    def original(self, name: str) -> Callable[..., Any]:
        """The Accelerator's own bound method ``name``."""
        return self._originals[name]

    def install(self) -> None:
        vars(self.accelerator).update(backward=self._backward, clip_grad_norm_=self._clip_grad_norm_,
                                      save_state=self._save_state)

    def remove(self) -> None:
        for name in self._originals:
            vars(self.accelerator).pop(name, None)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.losses.append(loss.detach())
        self._before_backward()
        self._originals["backward"](loss, **kwargs)

    def _clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self._max_grad_norm is None or float(max_norm) != self._max_grad_norm or norm_type != 2:
            raise ValueError(
                f"FaultTolerantHSDP clips the averaged gradients itself, so that a step replayed after a catch-up is "
                f"clipped like the trained one: pass max_grad_norm={max_norm} to FaultTolerantHSDP (it has "
                f"max_grad_norm={self._max_grad_norm}; 2-norm only) and keep or drop this call")
        return self._last_norm()

    def _save_state(self, output_dir: str | None = None, **kwargs: Any) -> str | None:
        if not self._writes_state():
            return None
        return self._originals["save_state"](output_dir, **kwargs)
