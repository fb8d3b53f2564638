"""The gradient exchange across replica groups: SUM over the cross-group process group, divided by the batches in it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_fthsdp.exchange.comm import CrossGroupComm


def average_gradients(comm: CrossGroupComm, tensors: Sequence[torch.Tensor], *, divisor: int,
                      contribute: bool) -> None:
    """Replace ``tensors`` in place by their SUM over ``comm``'s configured group divided by ``divisor``; one
    collective per dtype. ``contribute=False`` sends zeros in their place (a group whose weights are not the job's).

    Raises CollectiveAborted on any failure: the tensors then hold garbage.
    """
    # A private staging buffer: an abandoned gloo collective may still write into it after we walk away.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same_dtype in by_dtype.values():
        if contribute:
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype]).to(comm.device)
        else:
            flat = torch.zeros(sum(t.numel() for t in same_dtype), dtype=same_dtype[0].dtype, device=comm.device)
        comm.allreduce_sum(flat)
        flat.div_(divisor)
        offset = 0
        for t in same_dtype:
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
