"""Health checks of a 3D run: at start-up (rank-to-device map, agreement on layout and versions, clock skew) and every
K steps (data-parallel replicas still hold identical parameters).

Every check gathers the same facts on every rank and decides on every rank alike, so an error is raised everywhere at
once instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hybrid._version import __version__
from lightning_hybrid.config import HybridConfigError

__all__ = [
    "HealthCheckError",
    "HealthChecks",
    "add_monitoring_defaults",
    "check_monitor",
    "check_rank_device_map",
    "find_replica_mismatches",
]


class HealthCheckError(RuntimeError):
    """A run that cannot train correctly, found by :class:`HealthChecks` (the message says what and where)."""


def check_rank_device_map(devices: list[tuple[str, str]]) -> None:
    """Raise if two ranks on one host use the same accelerator. ``devices[rank] = (host, device identity)``; CPU
    ranks share the host's cores by design and are never a conflict.

    Example:
        >>> check_rank_device_map([("node0", "cuda:GPU-aa"), ("node0", "cuda:GPU-bb")])  # distinct: fine
        >>> check_rank_device_map([("node0", "cuda:GPU-aa"), ("node0", "cuda:GPU-aa")])
        Traceback (most recent call last):
        ...
        lightning_hybrid.monitoring.health.HealthCheckError: Ranks 0 and 1 both use device cuda:GPU-aa on host node0...
    """
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, device) in enumerate(devices):
        if device == "cpu" or device.startswith("cpu"):
            continue
        other = seen.setdefault((host, device), rank)
        if other != rank:
            raise HealthCheckError(
                f"Ranks {other} and {rank} both use device {device} on host {host}: each rank needs its own"
                " accelerator. Check the launcher's local-rank -> device mapping (CUDA_VISIBLE_DEVICES, `devices=`,"
                " torchrun --nproc_per_node = GPUs per node)."
            )


def find_replica_mismatches(names: list[str], checksums: torch.Tensor) -> list[str]:
    """Names whose checksum differs between data-parallel replicas; ``checksums`` is ``[replicas, len(names)]``.

    Example:
        >>> find_replica_mismatches(["a", "b"], torch.tensor([[1, 2], [1, 3]]))
        ['b']
    """
    differs = (checksums != checksums[0:1]).any(dim=0)
    return [n for n, bad in zip(names, differs.tolist()) if bad]


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A bitwise checksum (replicas must agree bit for bit: they apply the same reduced update): the raw bits as
    integers, weighted by position so that swapped elements also differ; int64 arithmetic wraps deterministically."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_OF_WIDTH[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum()


class HealthChecks(L.Callback):
    """Catch the mundane failures of 3D runs early. :class:`~lightning_hybrid.HybridStrategy` adds it by default
    (``health_checks=False`` turns it off, or pass your own instance to choose the checks).

    At start-up (``setup``):

    - rank-to-device map: two ranks on one accelerator is an error naming both (compared by the device's UUID, so
      per-process ``CUDA_VISIBLE_DEVICES`` is understood);
    - agreement: every rank must have resolved the same layout and run the same torch/Lightning/lightning-hybrid/
      Python versions; a difference is an error naming the ranks and values;
    - clock skew: host clocks further apart than ``clock_skew_seconds`` get a warning (logs and timelines of
      different nodes would not line up, and some stores' timeouts misfire).

    Every ``replica_check_every_n_steps`` optimizer steps: a checksum of every parameter that the data-parallel
    replicas hold identically (all of them under ZeRO 0-2; under ZeRO-3 those FSDP2 did not shard) is compared across
    replicas; a mismatch names the parameters and the step, and raises (``on_mismatch="raise"``) or warns.

    Arguments:
        rank_device_map: check the rank-to-device map at start-up.
        agreement: check that layout and versions agree at start-up.
        clock_skew_seconds: warn above this skew between hosts (None: no check).
        replica_check_every_n_steps: interval of the replica check (None or 0: never).
        on_mismatch: ``"raise"`` (stop the run on every rank) or ``"warn"``.

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> strategy = HybridStrategy(health_checks=HealthChecks(replica_check_every_n_steps=500))  # doctest: +SKIP
    """

    def __init__(
        self,
        rank_device_map: bool = True,
        agreement: bool = True,
        clock_skew_seconds: Optional[float] = 2.0,
        replica_check_every_n_steps: Optional[int] = 1000,
        on_mismatch: str = "raise",
    ) -> None:
        if on_mismatch not in ("raise", "warn"):
            raise HybridConfigError(
                f"`HealthChecks(on_mismatch={on_mismatch!r})`: pass 'raise' (stop the run on every rank when"
                " data-parallel replicas differ) or 'warn' (log it and go on)."
            )
        every = replica_check_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise HybridConfigError(
                f"`HealthChecks(replica_check_every_n_steps={every!r})`: pass a non-negative integer, the optimizer"
                " steps between replica checks (e.g. 1000), or 0 or None to never check."
            )
        skew = clock_skew_seconds
        if skew is not None and (isinstance(skew, bool) or not isinstance(skew, (int, float)) or not skew >= 0):
            raise HybridConfigError(
                f"`HealthChecks(clock_skew_seconds={skew!r})`: pass a non-negative number of seconds above which"
                " host clocks count as skewed (e.g. 2.0), or None to skip the check."
            )
        self.rank_device_map = rank_device_map
        self.agreement = agreement
        self.clock_skew_seconds = clock_skew_seconds
        self.replica_check_every_n_steps = every
        self.on_mismatch = on_mismatch
        self.reports: list[str] = []
        """Every problem found (errors and warnings), in order."""
        self.replica_checks = 0
        """How many replica checks ran."""
        self._started = False

    # ------------------------------------------------------------------ start-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._started or not (dist.is_available() and dist.is_initialized()):
            return
        self._started = True
        facts = self._local_facts(trainer)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.barrier()  # the clocks are read as close together as a barrier allows
        facts["time"] = time.time()
        dist.all_gather_object(everyone, facts)
        if self.rank_device_map:
            self._raise_if(lambda: check_rank_device_map([(f["host"], f["device"]) for f in everyone]))
        if self.agreement:
            self._raise_if(lambda: _check_agreement(everyone))
        if self.clock_skew_seconds is not None:
            self._check_clocks(everyone)

    def _local_facts(self, trainer: L.Trainer) -> dict[str, Any]:
        """What this rank reports at start-up (a test can override it to simulate a bad node)."""
        import lightning

        strategy = trainer.strategy
        layout = getattr(strategy, "layout", None)
        return {
            "host": socket.gethostname(),
            "device": device_identity(strategy.root_device),
            "layout": layout.as_dict() if layout is not None else None,
            "versions": {
                "torch": torch.__version__,
                "lightning": lightning.__version__,
                "lightning_hybrid": __version__,
                "python": platform.python_version(),
            },
            "pid": os.getpid(),
        }

    def _raise_if(self, check: Any) -> None:
        try:
            check()
        except HealthCheckError as error:
            self.reports.append(str(error))
            raise

    def _check_clocks(self, everyone: list[dict[str, Any]]) -> None:
        first_per_host: dict[str, float] = {}
        for f in everyone:
            first_per_host.setdefault(f["host"], f["time"])
        if len(first_per_host) < 2:
            return
        reference_host, reference = next(iter(first_per_host.items()))
        for host, t in first_per_host.items():
            skew = t - reference
            if abs(skew) > self.clock_skew_seconds:  # type: ignore[operator]
                message = (
                    f"The clock of host {host} is {skew:+.2f} s off host {reference_host} (threshold"
                    f" {self.clock_skew_seconds} s): synchronize the nodes' clocks (NTP/chrony); logs and traces from"
                    " different nodes will not line up."
                )
                self.reports.append(message)
                rank_zero_warn(message)

    # ------------------------------------------------------------------ every K steps
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self.replica_check_every_n_steps
        step = trainer.global_step
        if not every or step == 0 or step % every or step == getattr(self, "_checked_step", -1):
            return
        self._checked_step = step
        self.check_replicas(trainer, pl_module)

    def check_replicas(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Compare the replicated parameters across data-parallel replicas now (collective: call on all ranks);
        returns the names that differ (on every rank), after raising or warning as configured."""
        mesh = getattr(trainer.strategy, "device_mesh", None)
        if mesh is None or mesh["data"].size() == 1:
            return []
        data = mesh["data"]
        names, sums = [], []
        for name, p in pl_module.named_parameters():
            local = _replicated_local(p)
            if local is not None:
                names.append(name)
                sums.append(_checksum(local))
        device = trainer.strategy.root_device
        mine = torch.stack(sums).to(device) if sums else torch.zeros(0, dtype=torch.int64, device=device)
        gathered = torch.empty(data.size() * mine.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, mine, group=data.get_group())
        mismatched = find_replica_mismatches(names, gathered.view(data.size(), -1).cpu())
        self.replica_checks += 1
        # every rank learns whether any replica group differs (other tensor/pipeline coordinates may not), and which
        # names, so all raise together
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mismatched)
        mismatched = sorted({n for names_of_rank in everyone for n in names_of_rank})
        if mismatched:
            message = (
                f"Data-parallel replicas disagree at step {trainer.global_step} on {len(mismatched)} parameter(s):"
                f" {', '.join(mismatched[:20])}{' ...' if len(mismatched) > 20 else ''}. Replicas must hold"
                " identical copies; something updated one replica differently (a rank-dependent code path, a"
                " non-deterministic op outside the reduced gradients, or hardware corruption)."
            )
            self.reports.append(message)
            if self.on_mismatch == "raise":
                raise HealthCheckError(message)
            rank_zero_warn(message)
        return mismatched


def _replicated_local(p: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of ``p`` if data-parallel replicas should hold it identically, else None (ZeRO-3 shards)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p
    names = p.device_mesh.mesh_dim_names or ()
    for dim_name, placement in zip(names, p.placements):
        if dim_name == "data" and not placement.is_replicate():
            return None
    return p.to_local()


def device_identity(device: torch.device) -> str:
    """A device's identity across processes: the physical UUID for CUDA (per-process ``CUDA_VISIBLE_DEVICES`` renumber
    devices), else the device string."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return f"cuda:{uuid}" if uuid is not None else f"cuda:{index}"
    return str(device)


def _check_agreement(everyone: list[dict[str, Any]]) -> None:
    for key in ("layout", "versions"):
        reference = everyone[0][key]
        differing = [rank for rank, f in enumerate(everyone) if f[key] != reference]
        if differing:
            rank = differing[0]
            raise HealthCheckError(
                f"Ranks disagree on the {key}: rank 0 has {reference}, rank {rank} has {everyone[rank][key]}"
                f" (ranks {differing} differ). Every rank must run the same installation and configuration."
            )


def check_monitor(monitor: Any) -> None:
    """Refuse a ``monitor`` argument :func:`add_monitoring_defaults` cannot use (strategy constructor, every rank).

    Example:
        >>> check_monitor(False)
    """
    from lightning_hybrid.monitoring.callback import HybridMonitor

    if not isinstance(monitor, (bool, HybridMonitor)):
        raise HybridConfigError(
            f"`monitor={monitor!r}`: pass True (add HybridMonitor() when the Trainer has a logger), False, or a"
            " `lightning_hybrid.HybridMonitor(...)` instance."
        )


def add_monitoring_defaults(trainer: Any, health_checks: Any = True, monitor: Any = True) -> None:
    """What :class:`~lightning_hybrid.HybridStrategy` adds to every run (before the loggers start): an offline W&B
    run when there are no credentials; the health checks unless turned off or already present; and the
    :class:`~lightning_hybrid.monitoring.HybridMonitor` whenever the Trainer has a logger (or ``monitor`` is an
    instance), unless ``monitor=False`` or the callbacks already hold one.

    Example:
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(loggers=[], callbacks=[])
        >>> add_monitoring_defaults(trainer, health_checks=True, monitor=True)  # no logger: no monitor
        >>> [type(c).__name__ for c in trainer.callbacks]
        ['HealthChecks']
    """
    from lightning_hybrid.monitoring.callback import HybridMonitor
    from lightning_hybrid.monitoring.loggers import use_offline_wandb_without_credentials

    if trainer is None:
        return
    use_offline_wandb_without_credentials(trainer.loggers)
    if health_checks is not False and not any(isinstance(c, HealthChecks) for c in trainer.callbacks):
        trainer.callbacks.append(health_checks if isinstance(health_checks, HealthChecks) else HealthChecks())
    # the metrics go to the loggers: without one, only an explicitly given monitor is added (for its console line)
    wanted = isinstance(monitor, HybridMonitor) or (monitor is not False and bool(trainer.loggers))
    if wanted and not any(isinstance(c, HybridMonitor) for c in trainer.callbacks):
        trainer.callbacks.append(monitor if isinstance(monitor, HybridMonitor) else HybridMonitor())
