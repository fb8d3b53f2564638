"""Set an attribute on one object for a while, and put back exactly what was there (or nothing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def set_for_now(obj: object, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.<name>`` as an instance attribute (bypassing ``nn.Module.__setattr__``); returns the call that
    restores the instance attribute that was there before, or removes it (safe to call more than once)."""
    namespace = obj.__dict__
    before = namespace.get(name, _MISSING)
    namespace[name] = value

    def restore() -> None:
        if before is _MISSING:
            namespace.pop(name, None)
        else:
            namespace[name] = before

    return restore
