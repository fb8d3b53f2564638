"""What ``FaultTolerantHSDP`` refuses at construction, each with the fix: setups in which the replica groups could
not stay identical, or in which Accelerate's world is not one replica group."""

from __future__ import annotations

import os

from accelerate import Accelerator
from accelerate.utils import DistributedType

_UNSUPPORTED_TYPES = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


def refuse_unsupported(accelerator: Accelerator) -> None:
    """Raise ValueError for fp16, replication inside Accelerate's world, FSDP1, DeepSpeed/Megatron-LM/XLA, and a
    torchrun world Accelerate does not see."""
    if accelerator.mixed_precision == "fp16":
        raise ValueError(
            "FaultTolerantHSDP refuses mixed_precision='fp16': each replica group has its own loss scaler, so groups "
            "could skip different steps and their parameters would part. Use Accelerator(mixed_precision='bf16') "
            "(no loss scaling), or 'no'")
    config = accelerator.parallelism_config
    if config is not None and config.dp_replicate_size > 1:
        raise ValueError(
            f"FaultTolerantHSDP refuses ParallelismConfig(dp_replicate_size={config.dp_replicate_size}): replication "
            "across replica groups is FaultTolerantHSDP's, each Accelerate launch is one group that only shards. Set "
            "dp_replicate_size=1 and start one launch per replica group (fthsdp launch --script does)")
    if accelerator.distributed_type in _UNSUPPORTED_TYPES:
        raise ValueError(
            f"FaultTolerantHSDP supports FSDP2 (or DDP, or one process) inside a replica group, not "
            f"{accelerator.distributed_type.value}: use FullyShardedDataParallelPlugin(fsdp_version=2)")
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ValueError(
            "FaultTolerantHSDP needs FSDP2 inside the replica group: FullyShardedDataParallelPlugin(fsdp_version=2) "
            "(FSDP1's flat parameters are not supported)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ValueError(
            f"FaultTolerantHSDP: torchrun started {launched} processes for this replica group but Accelerate sees "
            f"{accelerator.num_processes}: each would take itself for the whole group. On a machine without GPUs "
            "pass Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=true) so Accelerate joins the processes over gloo")
