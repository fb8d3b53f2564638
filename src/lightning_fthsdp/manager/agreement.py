"""What the ranks of one replica group agree on: every rank's state-server address (over its own process group), the
leader's quorum answer and the commit vote (over its ``GroupLink`` once open, every step)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from concurrent import futures

import torch
import torch.distributed as dist

from lightning_fthsdp.config import log
from lightning_fthsdp.config.env import ENV_TOKEN
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.link import GroupLink
from lightning_fthsdp.manager.request import QuorumUnavailable
from lightning_fthsdp.membership.client import Excluded
from lightning_fthsdp.membership.connection import LighthouseRejected
from lightning_fthsdp.protocol.quorum import Quorum

_GATEWAY_TIMEOUT = 504
_UNAUTHORIZED = 401


class GroupAgreement:
    """The in-group collectives of one rank. ``process_group`` is the replica group's own (None for a one-rank
    group: every agreement is then this rank's own view); it must be CPU-capable (gloo). Every rank of the group
    must make the same calls in the same order; an error in them (a shard rank died) propagates."""

    def __init__(self, process_group: dist.ProcessGroup | None, replica_id: str, step: Callable[[], int]) -> None:
        self._process_group = process_group
        self._replica_id = replica_id
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.size = dist.get_world_size(process_group) if process_group is not None else 1
        self._qlog = log.ReplicaLogger(log.QUORUM, replica_id, self.rank, step)
        self.no_quorum_reason = ""
        """Why the last ``quorum()`` returned None."""
        self.excluded = False
        """Whether the last ``quorum()`` returned None because the lighthouse keeps this group out for now (it lives;
        the steps it cannot take meanwhile are no failures)."""
        self._link: GroupLink | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def incarnation(self) -> str:
        """A random id for this start of the group's processes, chosen by the leader and the same on every rank: the
        lighthouse lets only this incarnation speak for the group until it dies."""
        return str(self._broadcast_from_leader({"incarnation": secrets.token_hex(16)})["incarnation"])

    def open_link(self, host: str, token: str | None, incarnation: str, timeouts: Timeouts) -> None:
        """Carry the leader's words and the votes on a ``GroupLink`` from now on (every rank calls it at once; the
        leader listens on ``host``); a one-rank group has nobody to tell. A rank says hello as it connects: the
        leader gives it the heartbeat timeout, the group's bound for a rank that says nothing."""
        if self.size > 1:
            self._link = GroupLink.open(self.from_leader, rank=self.rank, size=self.size, host=host, token=token,
                                        incarnation=incarnation, timeout_s=timeouts.process_group_timeout_ms / 1000,
                                        hello_timeout_s=timeouts.heartbeat_timeout_ms / 1000)

    def on_link_broken(self, report: Callable[[int, str, str], None]) -> None:
        """The leader's report of a rank whose link broke (``GroupLink.on_broken``); nothing without a link."""
        if self._link is not None:
            self._link.on_broken = report

    def close(self) -> None:
        """Close the link (a rank still waiting on it learns this rank is gone)."""
        if self._link is not None:
            self._link.close()

    def from_leader(self, value: str) -> str:
        """The leader's ``value``, the same on every rank (the others pass anything)."""
        return str(self._broadcast_from_leader({"value": value})["value"])

    def gather_addresses(self, address: str) -> list[str]:
        """Every rank's state-server address (the leader advertises them all, shard rank order)."""
        if self.size == 1:
            return [address]
        addresses: list[object] = [None] * self.size
        dist.all_gather_object(addresses, address, group=self._process_group)
        return [str(a) for a in addresses]

    def quorum(self, answer: Callable[[], tuple[Quorum, str]] | None) -> tuple[Quorum, str] | None:
        """The leader's quorum and store address (``answer`` waits for them; None on the other ranks), shared with
        every rank. None on every rank: no quorum this step (a 504 from the lighthouse: retry). Any other error
        raises RuntimeError on every rank."""
        if self.size > 1:
            self._opened_link("quorum")
        message: dict[str, object] = {}
        if answer is not None:
            try:
                quorum, store = answer()
                message = {"quorum": quorum.to_json(), "store": store}
            except (TimeoutError, futures.TimeoutError):  # distinct classes before Python 3.11
                message = {"error": "the lighthouse client did not return within connect + quorum timeouts",
                           "fatal": True}
            except LighthouseRejected as exc:
                message = {"error": _with_fix(exc), "fatal": exc.status != _GATEWAY_TIMEOUT}
            except Excluded as exc:
                message = {"error": str(exc), "excluded": True}
            except QuorumUnavailable as exc:
                message = {"error": str(exc), "fatal": True}
        message = self._broadcast_from_leader(message)
        if "error" in message:
            if message.get("fatal"):
                raise RuntimeError(f"FTManager (group {self._replica_id}): {message['error']}")
            self.excluded = bool(message.get("excluded"))
            if not self.excluded or self.no_quorum_reason != message["error"]:
                self._qlog.warning("no quorum this step: %s", message["error"])
            self.no_quorum_reason = str(message["error"])
            return None
        self.excluded = False
        return Quorum.from_json(message["quorum"]), str(message["store"])  # type: ignore[arg-type]

    def vote(self, *flags: bool) -> tuple[bool, ...]:
        """Unanimity inside the group, flag by flag (commit? every rank's exchange succeeded? ...)."""
        if self.size == 1:
            return flags
        return self._opened_link("vote").vote(flags)

    def _opened_link(self, call: str) -> GroupLink:
        if self._link is None:
            raise RuntimeError(f"GroupAgreement (group {self._replica_id}): {call}() before open_link(): the group's "
                               f"per-step words go over its link only; open it once, after the incarnation")
        return self._link

    def _broadcast_from_leader(self, message: dict[str, object]) -> dict[str, object]:
        """Over the link once open; before it (the incarnation, the link's own address), over the process group."""
        if self.size == 1:
            return message
        payload = json.dumps(message).encode() if self.is_leader else b""
        if self._link is not None:
            data = self._link.broadcast(payload)
            return json.loads(data) if not self.is_leader else message
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, group_src=0, group=self._process_group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.is_leader else torch.empty(
            int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, group_src=0, group=self._process_group)
        return json.loads(bytes(data.tolist()).decode()) if not self.is_leader else message


def _with_fix(exc: LighthouseRejected) -> str:
    """The lighthouse's refusal, with what to change where the lighthouse's own words do not say it."""
    if exc.status == _UNAUTHORIZED:
        return (f"{exc}. The lighthouse refuses this group's token: give every group the lighthouse's token "
                f"(${ENV_TOKEN}, or FTManager(token=...) / FTHSDPStrategy(token=...))")
    return str(exc)
