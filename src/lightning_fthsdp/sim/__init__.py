"""Goodput simulator: effective training time of synchronous training versus FT-HSDP at any scale.

``SimConfig`` holds the inputs, ``closed_form`` evaluates the paper's arithmetic, ``engine.simulate`` runs the
discrete-event Monte Carlo (it needs numpy, the ``sim`` extra), ``sweep`` and ``plot`` cover grids, ``report``
calibrates from a launch's report.json. ``fthsdp simulate`` is the command line. See docs/simulator.md.
"""

from __future__ import annotations

from lightning_fthsdp.sim.closed_form import ClosedForm, closed_form
from lightning_fthsdp.sim.config import PRESETS, SimConfig

__all__ = ["PRESETS", "ClosedForm", "SimConfig", "closed_form"]
