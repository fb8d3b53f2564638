from __future__ import annotations

import argparse

import pytest

from lightning_fthsdp.config.env import ENV_LIGHTHOUSE, from_env, resolve
from lightning_fthsdp.config.timeouts import Timeouts, add_timeout_arguments, timeouts_from_args


def test_defaults_respect_the_hierarchy() -> None:
    t = Timeouts()
    assert t.heartbeat_interval_ms < t.heartbeat_timeout_ms < t.collective_timeout_ms < t.quorum_timeout_ms
    assert t.quorum_timeout_ms < t.connect_timeout_ms and t.join_timeout_ms < t.quorum_timeout_ms


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("heartbeat_timeout_ms", 50_000,
         "heartbeat_timeout_ms < collective_timeout_ms, got heartbeat_timeout_ms=50000"),
        ("collective_timeout_ms", 1_000, "heartbeat_timeout_ms < collective_timeout_ms"),
        ("quorum_timeout_ms", 200_000, "quorum_timeout_ms < connect_timeout_ms, got quorum_timeout_ms=200000"),
        ("heartbeat_interval_ms", 2_000, "heartbeat_interval_ms < heartbeat_timeout_ms"),
        ("join_timeout_ms", 60_000, "join_timeout_ms < quorum_timeout_ms, got join_timeout_ms=60000"),
        ("collective_timeout_ms", 0, "collective_timeout_ms must be a positive integer"),
        ("connect_timeout_ms", 1.5, "connect_timeout_ms must be a positive integer of milliseconds, got 1.5"),
        ("process_group_timeout_ms", 150_000, "process_group_timeout_ms > connect_timeout_ms + quorum_timeout_ms + "
                                              "heartbeat_timeout_ms + 10000 .*, got process_group_timeout_ms=150000, "
                                              "connect_timeout_ms=120000, quorum_timeout_ms=60000 and "
                                              "heartbeat_timeout_ms=2000"),
        ("max_failed_commits", 0, "max_failed_commits must be a positive integer (a count), got 0"),
    ],
)
def test_inconsistent_timeouts_are_refused_with_the_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        Timeouts(**{field: value})  # type: ignore[arg-type]


def test_cli_options_come_from_the_dataclass_with_its_docstrings() -> None:
    parser = argparse.ArgumentParser()
    add_timeout_arguments(parser)
    assert "declared dead" in parser.format_help()
    args = parser.parse_args(["--heartbeat-timeout-ms", "500", "--heartbeat-interval-ms", "50"])
    assert timeouts_from_args(args) == Timeouts(heartbeat_timeout_ms=500, heartbeat_interval_ms=50)


def test_explicit_value_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_LIGHTHOUSE, "http://env:1")
    assert resolve("http://arg:2", ENV_LIGHTHOUSE, "x", "fix") == "http://arg:2"
    assert resolve(None, ENV_LIGHTHOUSE, "x", "fix") == "http://env:1"
    assert from_env(None, "FTHSDP_UNSET_FOR_TEST") is None
    monkeypatch.delenv(ENV_LIGHTHOUSE)
    with pytest.raises(ValueError, match="lighthouse is not set: pass it explicitly or set FTHSDP_LIGHTHOUSE"):
        resolve(None, ENV_LIGHTHOUSE, "FTManager lighthouse", "fix")
