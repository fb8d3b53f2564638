from __future__ import annotations

from collections.abc import Iterator

import pytest
from accelerate.state import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: every in-process test builds its own Accelerator."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
