"""DataTopology: how the job's training data is split over the replica groups, and which share is this group's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_fthsdp.config.env import ENV_REPLICA_INDEX, ENV_REPLICAS, from_env


@dataclass(frozen=True)
class DataTopology:
    """The data is split into one stream per replica group, healthy or not; this group trains stream
    ``replica_index`` of ``replicas`` (each stream again split over the group's shard ranks)."""

    replicas: int
    """Replica groups in the job: the streams, and the quorum size no quorum may exceed."""
    replica_index: int
    """This group's stream, in ``[0, replicas)``."""
    owner: str = field(default="FTHSDPStrategy", compare=False)
    """The front end whose arguments these are (``FTHSDPStrategy``, ``FaultTolerantHSDP``): errors name it."""

    def __post_init__(self) -> None:
        _check_replicas(self.replicas, self.owner)
        if not 0 <= self.replica_index < self.replicas:
            raise ValueError(f"{self.owner} needs 0 <= replica_index < replicas, got replica_index="
                             f"{self.replica_index} and replicas={self.replicas}")

    @classmethod
    def resolve(cls, replica_id: str, replicas: int | None, replica_ids: list[str] | None,
                replica_index: int | None, owner: str = "FTHSDPStrategy") -> DataTopology:
        """From the front end's (``owner``'s) arguments, then ``$FTHSDP_REPLICAS`` and ``$FTHSDP_REPLICA_INDEX``: the
        group count defaults to ``len(replica_ids)``, else 1; the index to ``replica_id``'s position in
        ``replica_ids``, else 0 when there is one group. Raises ValueError on values that contradict each other."""
        if replicas is None:
            replicas = len(replica_ids) if replica_ids is not None else int(from_env(None, ENV_REPLICAS) or "1")
        _check_replicas(replicas, owner)
        if replica_ids is not None:
            if len(replica_ids) != replicas:
                raise ValueError(f"{owner} got {len(replica_ids)} replica_ids {replica_ids} but "
                                 f"replicas={replicas}: list every group once")
            if replica_id not in replica_ids:
                raise ValueError(f"{owner} replica_id={replica_id!r} is not in replica_ids={replica_ids}")
            index_from_ids = replica_ids.index(replica_id)
            if replica_index is not None and replica_index != index_from_ids:
                raise ValueError(f"{owner} got replica_index={replica_index} but replica_id={replica_id!r} is "
                                 f"at position {index_from_ids} of replica_ids: pass one of them")
            replica_index = index_from_ids
        if replica_index is None:
            index_env = os.environ.get(ENV_REPLICA_INDEX)
            if index_env is not None:
                replica_index = int(index_env)
            elif replicas == 1:
                replica_index = 0
            else:
                raise ValueError(
                    f"{owner} needs this group's data shard with replicas={replicas}: pass "
                    f"replica_ids=[...] (every group's id, in order) or replica_index (or set ${ENV_REPLICA_INDEX})")
        return cls(replicas, replica_index, owner)

    def check_quorum(self, member_ids: Sequence[str], replica_id: str) -> None:
        """Refuse a quorum of more groups than there are streams: some groups' data would overlap."""
        if len(member_ids) > self.replicas:
            raise ValueError(
                f"{self.owner} (group {replica_id}) has replicas={self.replicas} but the "
                f"quorum holds {len(member_ids)} groups ({','.join(member_ids)}): their data shards "
                f"would overlap. Set replicas (or ${ENV_REPLICAS}) to the job's group count"
            )


def _check_replicas(replicas: int, owner: str) -> None:
    if replicas < 1:
        raise ValueError(f"{owner} needs replicas >= 1, got {replicas}")
