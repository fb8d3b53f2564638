"""Deprecated: ``lightning_fthsdp.config.timeouts`` and ``lightning_fthsdp.config.env`` (until 0.3)."""

from lightning_fthsdp.config.env import ENV_LIGHTHOUSE, ENV_REPLICA_ID, ENV_TOKEN, from_env, resolve
from lightning_fthsdp.config.timeouts import Timeouts, add_timeout_arguments, field_docs, timeouts_from_args

__all__ = ["ENV_LIGHTHOUSE", "ENV_REPLICA_ID", "ENV_TOKEN", "Timeouts", "add_timeout_arguments", "field_docs",
           "from_env", "resolve", "timeouts_from_args"]
