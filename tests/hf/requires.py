"""The Hugging Face tests need ``transformers`` (the ``hf`` extra): without it they are skipped, saying why, unless
``$FTHSDP_REQUIRE_HF`` is set (CI, whose set-up installs the extra): then they fail."""

from __future__ import annotations

import os

import pytest

ENV_REQUIRE_HF = "FTHSDP_REQUIRE_HF"


def require_transformers() -> None:
    """Skip the calling test module when ``transformers`` cannot be imported (fail it under ``$FTHSDP_REQUIRE_HF``)."""
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        reason = f"transformers cannot be imported ({error}): pip install -e .[hf]"
        if os.environ.get(ENV_REQUIRE_HF):
            pytest.fail(f"{reason}, although ${ENV_REQUIRE_HF} is set", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
