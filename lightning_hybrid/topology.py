"""The 3D device mesh (pipeline, data, tensor) and the start-up rank table."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid.config import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIM_NAMES", "build_device_mesh", "format_rank_table", "gather_rank_devices"]

# Pipeline slowest, tensor fastest: consecutive ranks form a tensor-parallel group, so it stays inside a node where
# the links are fastest (Megatron's default order); pipeline stages cross the slow links.
MESH_DIM_NAMES = ("pipeline", "data", "tensor")


def build_device_mesh(layout: ParallelLayout, device_type: str, timeout: Optional[timedelta] = None) -> DeviceMesh:
    """Create the ``DeviceMesh`` with named dimensions ``("pipeline", "data", "tensor")``; its groups get ``timeout``
    (DeviceMesh creates them with torch's default timeout otherwise, not the default group's).

    Example:
        >>> # after torch.distributed is initialised with 8 processes
        >>> # mesh = build_device_mesh(ParallelLayout.resolve(world_size=8, tensor_parallel_size=2), "cpu")
        >>> # mesh["tensor"].size()  # -> 2
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size)
    override = None
    if timeout is not None:
        # a dimension spanning the world reuses the default group (which has the timeout already): no override there
        override = {n: _options(timeout) for n, size in zip(MESH_DIM_NAMES, shape) if size < layout.world_size}
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES, backend_override=override or None)


def _options(timeout: timedelta) -> tuple[str, Any]:
    """(backend, options with ``timeout``) for a mesh dimension's groups, on the default group's backend."""
    backend = dist.get_backend()
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def gather_rank_devices(device: torch.device) -> list[tuple[str, str, int]]:
    """(hostname, device, local pid) of every rank, gathered on all ranks (used by the table and the health checks)."""
    import os
    import socket

    mine = (socket.gethostname(), str(device), os.getpid())
    if not dist.is_available() or not dist.is_initialized():
        return [mine]
    out: list[Optional[tuple[str, str, int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [o for o in out if o is not None]


def format_rank_table(layout: ParallelLayout, rank_devices: list[tuple[str, str, int]]) -> str:
    """One compact table: the layout, then each rank's (pipeline, data, tensor) coordinates and device."""
    head = (
        f"lightning-hybrid: world={layout.world_size}  tp={layout.tensor_parallel_size}"
        f"  pp={layout.pipeline_parallel_size}  dp={layout.data_parallel_size}  zero_stage={layout.zero_stage}"
        f"  sequence_parallel={layout.sequence_parallel}"
    )
    extras = "  ".join(f"{k}={v}" for k, v in layout.extras.items())
    lines = [head] + ([f"  {extras}"] if extras else [])
    lines.append(f"  {'rank':>4}  {'pp':>2} {'dp':>2} {'tp':>2}  device")
    for rank, (host, device, _) in enumerate(rank_devices):
        p, d, t = layout.coordinates(rank)
        lines.append(f"  {rank:>4}  {p:>2} {d:>2} {t:>2}  {host}:{device}")
    return "\n".join(lines)
