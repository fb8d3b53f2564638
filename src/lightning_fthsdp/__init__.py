"""lightning-fthsdp: Fault Tolerant Hybrid-Sharded Data Parallelism for PyTorch.

Packages by plane, each importing only those below it (``scripts/check_layers.py`` holds them to it): ``config``;
``lighthouse`` (control plane), ``exchange`` (data plane across groups), ``recovery`` (catch-up), ``data`` (each
group's data stream); ``manager`` (one fault-tolerant step); front ends ``lightning``, ``accelerate``, ``launch`` and
``demo``. Nothing below the front ends imports Lightning or Accelerate.

With Lightning installed, importing this package registers ``Trainer(strategy="fthsdp")``: at once if
``lightning.pytorch`` is already imported, else as soon as it is. The hook is there because Lightning has no entry
point for strategies, and importing Lightning eagerly would cost every process that never uses it (the lighthouse,
the plain training loop) seconds of start-up.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import time
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_IMPORTED_AT = time.time()  # when Python reached our package (stdlib only above): anatomy's "interpreter" milestone

from lightning_fthsdp.config.version import VERSION  # noqa: E402 (after _IMPORTED_AT: only the stdlib may precede it)

__version__ = VERSION

_LIGHTNING = "lightning.pytorch"


def _register_strategy() -> None:
    front_end = sys.modules.get("lightning_fthsdp.lightning")
    if front_end is not None and not hasattr(front_end, "register"):
        return  # it is being imported (and imported Lightning): it registers itself when its import ends
    from lightning_fthsdp.lightning import register

    register()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Runs the registration right after ``lightning.pytorch`` has been imported, then removes itself."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_strategy()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


# Lightning has no entry point for strategies: the name "fthsdp" exists only once this registration ran.
if _LIGHTNING in sys.modules:
    _register_strategy()
elif importlib.util.find_spec("lightning") is not None:
    sys.meta_path.insert(0, _RegisterAfterLightning())


def __getattr__(name: str) -> Any:
    """``lightning_fthsdp.FTHSDPStrategy`` (a LightningCLI class path) without importing Lightning eagerly."""
    if name == "FTHSDPStrategy":
        from lightning_fthsdp.lightning import FTHSDPStrategy

        return FTHSDPStrategy
    raise AttributeError(f"module 'lightning_fthsdp' has no attribute {name!r}")
