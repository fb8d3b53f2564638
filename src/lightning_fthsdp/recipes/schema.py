"""The structured configs every recipe is validated against: one dataclass per section, a docstring per field.

A recipe (``recipes/*.yaml``) sets any subset of these fields; everything it leaves out keeps the default here.
Fields with a fixed set of values declare it as ``metadata={"choices": ...}`` and numeric fields their bounds as
``metadata={"min": ..., "max": ...}``; every number must be finite and, where its field names no ``max``, at most
``MAGNITUDE`` (a value beyond it is a typo, never a plan). ``lightning_fthsdp.recipes.loader`` enforces all of it and
names the key, the value and what is allowed. Cross-field rules live in each section's ``check()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.stragglers import MODES as STRAGGLER_MODES
from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy
from lightning_fthsdp.recipes import components


def _choice(default: str, *choices: str) -> Any:
    return field(default=default, metadata={"choices": choices})


#: The bound of a number whose field names none.
MAGNITUDE = 10**9

#: The largest step a durable checkpoint's folder name holds (``recovery.checkpoint.checkpoint_path``).
MAX_STEP = 10**9 - 1


def _at_least(default: float, minimum: float, maximum: float | None = None) -> Any:
    return field(default=default, metadata={"min": minimum} | ({"max": maximum} if maximum is not None else {}))


@dataclass
class TrainerConfig:
    """The Lightning Trainer of every replica group."""

    accelerator: str = _choice("cpu", "cpu", "gpu", "cuda", "auto")
    """Where each rank runs. "cpu" uses gloo inside and across groups; "gpu"/"cuda" uses NCCL."""
    precision: str = _choice("32-true", "32-true", "bf16-mixed", "bf16-true")
    """Lightning precision plugin: the values FTHSDPStrategy accepts. bf16 runs on a CPU or a GPU that supports it.
    "16-mixed" is refused: fp16 needs a gradient scaler, whose skipped steps and scale the shard ranks and replica
    groups could not agree on; bf16-mixed trains in half precision without one."""
    max_steps: int = _at_least(200, 1, MAX_STEP)
    """Committed optimizer steps every group trains to (the job ends when all reach it)."""
    gradient_clip_val: float | None = None
    """Clip the global gradient norm (after the cross-group average) to this; null: no clipping."""
    log_every_n_steps: int = _at_least(10, 1)
    """Lightning's logging cadence (the launcher's own JSONL records every step regardless)."""
    val_every_n_steps: int = _at_least(100, 0)
    """Evaluate the held-out validation loss after every committed step that is a multiple of this, and after the
    last one (0: only after the last); every group evaluates the same steps. The launch report and plot carry it."""
    seed: int = _at_least(0, 0, 2**32 - 1)
    """Seed of every process: all groups start from the same initial weights (0 to 2**32 - 1, Lightning's range)."""
    min_step_time_s: float = _at_least(0.0, 0.0, 3600.0)
    """Pad each step to at least this many seconds. For demos and tests of tiny models, so that a killed
    group restarts before the survivors finish; 0 in real training."""


@dataclass
class FTConfig:
    """Fault tolerance: the lighthouse's quorum rule, degraded training and the timeout hierarchy."""

    min_replicas: int = _at_least(1, 1)
    """Smallest quorum the lighthouse forms. Lower keeps training through more failures; it must not exceed
    launch.replicas (else one failure stops the job)."""
    lr_scaling: str = _choice("none", "none", "linear", "sqrt")
    """Learning-rate factor while h of R groups contribute: 1, h/R or sqrt(h/R). Default none, as the strategy's;
    the paper found sqrt best, which recipes/base.yaml sets."""
    keep_global_batch: bool = False
    """While h of R groups contribute, the healthy ones train R/h times their batches (split as evenly as possible)
    so the global batch stays that of a healthy job; steps take longer. Needs lr_scaling=none."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """The bounded waits (milliseconds), validated as heartbeat < collective < quorum < connect;
    see docs/timeouts.md."""
    checkpoint_dir: str = ""
    """Durable checkpoints of every group's state go under this folder (every group must reach it: a shared file
    system on a cluster); "" writes none. The fallback when every group holding the job's committed step is down at
    once: the lighthouse waits for one (its lost-state wait), then every group loads the newest complete checkpoint
    instead of restarting from step 0. ``fthsdp launch`` puts a relative folder under its --out folder."""
    checkpoint_every_n_steps: int = _at_least(0, 0)
    """Write a checkpoint every this many committed steps (0: none, only load one). One contributing group writes
    it in the background (a CPU copy overlapped with forward and backward, then the disk): more often loses fewer
    steps when every holder fails at once, and costs that group more copies and I/O. Needs checkpoint_dir."""
    lost_state_wait_ms: int = _at_least(30_000, 0)
    """When no live group holds the job's committed step, the lighthouse waits this many milliseconds for one (a hung
    holder may come back) before resuming from the newest checkpoint (or, without one, an older step) and reporting
    the steps lost. Longer keeps more work after a transient failure of every holder; shorter trains again sooner."""
    checkpoint_keep: int = _at_least(2, 1)
    """Complete checkpoints kept; older ones are removed once a newer one is complete."""
    advertise_host: str = ""
    """The address the other replica groups reach this group's ranks at (catch-up state server, heartbeat relay,
    cross-group gloo device), e.g. the host's address on the network the groups share. "" (default):
    $FTHSDP_ADVERTISE_HOST if set, else each host's local address on the route to the lighthouse, right when the
    lighthouse is reached over that network. A recipe is one value for every group: set it only where all groups run
    on one host, else per host through $FTHSDP_ADVERTISE_HOST (``fthsdp slurm`` and ``fthsdp k8s`` refuse it; see
    docs/launch.md, "Addresses across hosts"). A loopback address while the lighthouse is on another host is refused."""
    straggler_policy: str = _choice("off", *STRAGGLER_MODES)
    """What the lighthouse does about a group whose compute or link drags every step (its --straggler-policy).
    "off": measure each group's step time and the time the others waited for it, and show them; "report": also flag
    stragglers (status, metrics, page, event log); "evict": also keep each out of the quorum until it keeps pace
    again (it catches up when it comes back). See docs/metrics.md, "Stragglers"."""
    straggler_factor: float = 2.0
    """A group whose median step time exceeds this many times the others' is a straggler (> 1; its
    --straggler-factor). Lower catches smaller slowdowns and mistakes noise for one sooner."""
    straggler_window: int = _at_least(20, 3)
    """Steps each median is taken over, a link trial lasts, and an evicted group stays out at least (doubling with
    each repeated eviction; its --straggler-window). Longer is steadier and slower to act."""

    @property
    def stragglers(self) -> StragglerPolicy:
        """The lighthouse's straggler policy these keys make."""
        return StragglerPolicy(self.straggler_policy, self.straggler_factor, self.straggler_window)

    def check(self, key: str) -> None:
        if self.checkpoint_every_n_steps and not self.checkpoint_dir:
            raise ValueError(f"{key}.checkpoint_every_n_steps={self.checkpoint_every_n_steps} needs "
                             f"{key}.checkpoint_dir: name the folder the checkpoints go to")
        if not self.straggler_factor > 1:
            raise ValueError(f"{key}.straggler_factor={self.straggler_factor!r} must be > 1 (2.0: a group over twice "
                             f"the others' median step time is a straggler)")


@dataclass
class LaunchConfig:
    """How ``fthsdp launch`` runs the job on this machine."""

    replicas: int = _at_least(2, 1, 1024)
    """Replica groups (--replicas wins). Each holds a full copy of the model and optimizer state."""
    shard_count: int = _at_least(1, 1, 16384)
    """Shard ranks per replica group, one device each (--shard-count wins); every group uses the same."""
    max_restarts: int = _at_least(10, 0)
    """Restarts per group within any launch.restart_window_s before the launcher gives up on it (a crash or an
    injected kill counts). Failures spread over a long job never add up to giving a group up."""
    restart_window_s: float = _at_least(3600.0, 1.0)
    """The window launch.max_restarts counts in, e.g. 3600: at most max_restarts per group in any hour."""
    restart_delay_s: float = _at_least(1.0, 0.0)
    """Pause before restarting a dead group (a real scheduler takes longer to find it a node)."""
    chaos: str = ""
    """Failure schedule (--chaos wins), e.g. "kill:at=step40:group=b,hang:at=30s:for=5s"; see docs/launch.md."""
    chaos_seed: int = 0
    """Seed of the random choices of the chaos schedule (which group, when none is named)."""
    timeout_s: float = _at_least(900.0, 1.0)
    """Bound on the whole run; the launcher stops every process and reports failure when it passes."""
    standby: bool = True
    """Keep, per group, its next incarnation started and imported ahead (one at a time, once the group trains), so a
    restart begins after the imports: its process start and imports (most of a Lightning start-up) are off the
    restart's path. Costs each group an idle process per shard rank and their imports' CPU while it trains; false:
    a restart starts from a bare process."""
    hosts: bool = False
    """Run the lighthouse and each replica group on a host of its own (--hosts wins): a Linux network namespace with
    its own address, all joined by a bridge, made for the run and removed at its end. Needs root and iproute2
    (scripts/install_network.sh); what runs on loopback otherwise. Needed by the network faults of launch.chaos
    (partition, slowlink, flap); the groups' cross-host traffic then takes the paths it takes on a real cluster."""


@dataclass
class RecipeConfig:
    """A complete training job: what to train (model and data), how, and how to launch it."""

    model: Any = None
    """The LightningModule every group trains: any class with its arguments, as LightningCLI writes it
    (``{class_path: pkg.Module, init_args: {...}}``) or as Hydra does (``{_target_: pkg.Module, ...}``); see
    ``lightning_fthsdp.recipes.components``. The built-in ones are the options of config group ``model``."""
    data: Any = None
    """The LightningDataModule, in the same forms; null: the module's own dataloaders. Config group ``data``."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The Lightning Trainer."""
    ft: FTConfig = field(default_factory=FTConfig)
    """Fault tolerance."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """The local launcher."""

    def check(self, key: str) -> None:
        components.check("model", self.model)
        components.check("data", self.data)
        if self.ft.min_replicas > self.launch.replicas:
            raise ValueError(f"ft.min_replicas={self.ft.min_replicas} exceeds launch.replicas="
                             f"{self.launch.replicas}: the lighthouse could never form a quorum; lower ft.min_replicas")
        if self.ft.keep_global_batch and self.ft.lr_scaling != "none":
            raise ValueError(f"ft.keep_global_batch=true keeps the global batch constant while degraded, so "
                             f"ft.lr_scaling={self.ft.lr_scaling} (a factor for a shrinking batch) does not apply: set "
                             "ft.lr_scaling=none")
