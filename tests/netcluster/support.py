"""Whether tests can build a cluster of network-namespace hosts here: they skip, saying why, where not (not root, no
iproute2), unless ``$FTHSDP_REQUIRE_NETNS`` is set (CI, after scripts/install_network.sh): then they fail."""

from __future__ import annotations

import os

import pytest

from lightning_fthsdp.netcluster import available

ENV_REQUIRE_NETNS = "FTHSDP_REQUIRE_NETNS"


def require_netns() -> None:
    """Skip the calling test (fail it under ``$FTHSDP_REQUIRE_NETNS``) when no cluster can be built here."""
    reason = available()
    if reason is None:
        return
    if os.environ.get(ENV_REQUIRE_NETNS):
        pytest.fail(f"no network namespaces although ${ENV_REQUIRE_NETNS} is set: {reason}")
    pytest.skip(f"no network namespaces: {reason}")
