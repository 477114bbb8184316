"""The 3D device mesh (pipeline, data, tensor) and the start-up rank table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from lightning_hybrid.config import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIM_NAMES", "build_device_mesh", "format_rank_table", "gather_rank_devices"]

# Pipeline slowest, tensor fastest: consecutive ranks form a tensor-parallel group, so it stays inside a node where
# the links are fastest (Megatron's default order); pipeline stages cross the slow links.
MESH_DIM_NAMES = ("pipeline", "data", "tensor")


def build_device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """Create the ``DeviceMesh`` with named dimensions ``("pipeline", "data", "tensor")``.

    Example:
        >>> # after torch.distributed is initialised with 8 processes
        >>> # mesh = build_device_mesh(ParallelLayout.resolve(world_size=8, tensor_parallel_size=2), "cpu")
        >>> # mesh["tensor"].size()  # -> 2
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES, backend_override=_own_groups(shape))


def _own_groups(shape: tuple[int, ...]) -> Optional[dict[str, str]]:
    """A gloo group of its own for each mesh dimension that spans all ranks, which DeviceMesh would otherwise give the
    default group itself. The default group is the one a script's last collective runs on (results gathered after
    ``fit``), and the mesh's groups live on in pipeline stages, FSDP state and metrics after ``fit``: aliased, the
    default group outlives ``destroy_process_group`` (gloo's ``shutdown`` does nothing; only its destructor stops its
    threads), and a gloo worker still releasing that last collective's tensors when the interpreter finalizes takes
    the GIL there and aborts the process ("terminate called without an active exception"). With groups of their own,
    the default group is freed, and its threads joined, when the groups are destroyed at exit. NCCL's ``shutdown``
    stops its communicators, so NCCL dimensions keep the default group (and save a communicator)."""
    world = dist.get_world_size()
    if world == 1 or dist.get_backend() != "gloo":
        return None
    return {name: "gloo" for name, size in zip(MESH_DIM_NAMES, shape) if size == world} or None


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
