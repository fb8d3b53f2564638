"""TEST ONLY: let Accelerate take its real FSDP2 path on CPU processes talking gloo.

Accelerate decides the distributed type in ``AcceleratorState.__init__``. A process on a machine without an
accelerator is a multi-process CPU job only when asked (``accelerate launch --cpu`` sets ``ACCELERATE_USE_CPU``;
otherwise each torchrun rank believes it is alone); then it turns a given ``fsdp_plugin`` into
``DistributedType.FSDP`` only for the GPU-like multi-process types (``MULTI_GPU``, ``MULTI_XPU``, ...); on CPU it
stays ``MULTI_CPU``, the plugin is dropped and ``prepare`` wraps the model in DDP (and ``accelerate launch --cpu
--use_fsdp`` refuses). ``allow_fsdp_on_cpu`` does, after that ``__init__``, what Accelerate itself does for those
types: set the type to FSDP and keep the plugin. Everything after it (``prepare``'s ``fully_shard``, ``accumulate``'s
``set_requires_gradient_sync``, ``clip_grad_norm_`` over DTensors, ``save_state``) is Accelerate's own code.
torch's FSDP2 runs on CPU with gloo, so the tests exercise the very path a GPU job takes, on this machine.

Never import this outside tests: a CPU job has no reason to shard (use ``Accelerator(cpu=True)`` there).
``run_script`` is how a test runs an unchanged script with it: ``python tests/accelerate/cpu_fsdp.py SCRIPT ARGS``.
"""

from __future__ import annotations

import os
import runpy
import sys


def allow_fsdp_on_cpu() -> None:
    """Patch ``AcceleratorState.__init__`` (idempotent) so a CPU process given an ``fsdp_plugin`` gets FSDP."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets: MULTI_CPU over gloo
    if getattr(AcceleratorState.__init__, "_fthsdp_cpu_fsdp", False):
        return
    original = AcceleratorState.__init__

    def init(self: AcceleratorState, *args: object, fsdp_plugin: object = None, **kwargs: object) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._fthsdp_cpu_fsdp = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def run_script(argv: list[str]) -> None:
    """Run the script ``argv[0]`` with arguments ``argv[1:]`` as ``__main__``, FSDP allowed on CPU."""
    allow_fsdp_on_cpu()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` has it: the script's own modules
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
