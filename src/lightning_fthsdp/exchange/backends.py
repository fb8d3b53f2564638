"""The raw backend process groups a cross-group communicator is built from, gloo or NCCL, and the refusal of a
backend that cannot work here.

Errors no retry can fix (a backend name that does not exist, NCCL missing) raise ``CrossGroupConfigError`` at once
instead of aborting the step.

Addresses (docs/launch.md, "Addresses across hosts"): the gloo device binds the rank's advertised address
(``advertise_host``) unless ``GLOO_SOCKET_IFNAME`` is set; left alone, gloo takes the address its host name resolves
to, which may be loopback or no address of this host. For NCCL, ``NCCL_SOCKET_IFNAME`` is set (when unset) to the
interface holding that address. A store address whose host is the wildcard (a lighthouse bound to ``0.0.0.0``) is
dialled at the lighthouse URL's host instead.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lightning_fthsdp.config import addresses
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.errors import CrossGroupConfigError

BACKENDS = ("gloo", "nccl")


def new_backend(
    backend: str, store: dist.Store, rank: int, size: int, timeout_ms: int, device: torch.device,
    advertise_host: str | None = None,
) -> dist.ProcessGroup:
    """A raw backend process group (no default group needed), gloo or NCCL. ``advertise_host``: the address gloo's
    device binds and publishes to its peers (None, or ``GLOO_SOCKET_IFNAME`` set: gloo's own choice); NCCL takes its
    interface from ``NCCL_SOCKET_IFNAME`` (see ``CrossGroupComm``)."""
    timeout = Timeouts.delta(timeout_ms)
    if backend == "gloo":
        if advertise_host is None or os.environ.get(addresses.GLOO_SOCKET_IFNAME):
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        # Gloo's default device takes the address the host name resolves to: loopback on many distributions, or an
        # address peers on other hosts cannot reach. lazy_init=None keeps TORCH_GLOO_LAZY_INIT's choice.
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=advertise_host)]
        try:
            return dist.ProcessGroupGloo(store, rank, size, options)
        except BaseException:
            # The error keeps this frame, and so the device: its loop thread would live on, still retrying the
            # connects of the pairs the failed constructor destroyed, and run them once the peer is reachable again
            # (a healed cut) on freed memory. Released now, its loop ends first.
            options._devices = []
            raise
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        # Connect eagerly so a missing peer fails here, inside the bounded rendezvous, not in the first allreduce.
        pg.eager_connect_single_device(device)
        return pg
    raise CrossGroupConfigError(f"CrossGroupComm backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse at once what no retry fixes: an unknown backend, NCCL without NCCL or without a CUDA device."""
    if backend not in BACKENDS:
        raise CrossGroupConfigError(f"CrossGroupComm backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
    if backend != "nccl":
        return
    if not dist.is_nccl_available():
        raise CrossGroupConfigError(
            f"CrossGroupComm backend 'nccl' needs a torch build with NCCL, and torch {torch.__version__} has none: "
            "install a CUDA build of torch, or use backend 'gloo' (CPU tensors)")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CrossGroupConfigError(
            f"CrossGroupComm backend 'nccl' needs a CUDA device, got device {str(device)!r} (CUDA available: "
            f"{torch.cuda.is_available()}): pass a cuda device, or use backend 'gloo' for CPU training")
