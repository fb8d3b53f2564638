"""The package's version, in one place: pyproject.toml reads it (a dynamic version), and so do
``lightning_fthsdp.__version__`` and ``fthsdp --version``."""

from __future__ import annotations

VERSION = "0.1.0"
