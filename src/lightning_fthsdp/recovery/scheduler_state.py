"""LR schedulers as catch-up state: the JSON part of each ``state_dict`` (what every front end registers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_fthsdp.recovery.wire import StateTree


def scheduler_state(schedulers: list[Any]) -> StateTree:
    """What a restarted group receives of the schedulers: the JSON part of each state (lambdas and other objects
    cannot travel and are not state)."""
    return {str(i): _jsonable(s.state_dict()) for i, s in enumerate(schedulers)}


def load_scheduler_state(schedulers: list[Any], tree: StateTree) -> None:
    for i, scheduler in enumerate(schedulers):
        state = scheduler.state_dict()
        state.update(tree[str(i)])
        scheduler.load_state_dict(state)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if _is_plain(v)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _is_plain(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_is_plain(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)
