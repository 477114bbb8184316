"""The processes of a job and how they are arranged: the process groups, the 3D device mesh (pipeline, data,
tensor), the hang watchdog over it, the start-up rank table, and the world-wide collectives the strategy offers
Lightning (barrier, broadcast)."""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh

import lightning_hybrid._lightning_compat as compat
from lightning_hybrid._torch_compat import group_options
from lightning_hybrid.layout import ParallelLayout
from lightning_hybrid.process_groups import forget_subgroups
from lightning_hybrid.watchdog import HangWatchdog, configure_flight_recorder

__all__ = [
    "LIGHTNING_DIM_NAMES",
    "MESH_DIM_NAMES",
    "HybridDeviceMesh",
    "Topology",
    "barrier",
    "broadcast_object",
    "reduce",
    "share_random_state",
    "build_context_mesh",
    "build_device_mesh",
    "build_expert_mesh",
    "init_process_groups",
    "format_rank_table",
    "gather_rank_devices",
    "start_topology",
    "with_lightning_names",
]

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

    # under context parallel the data dimension holds each replica's context-parallel ranks too (same weights)
    shape = (layout.pipeline_parallel_size, layout.data_dimension_size, layout.tensor_parallel_size)
    key = (shape, device_type, dist.get_backend(), timeout)
    cached = _MESHES.get(key)
    if cached is not None and _groups_alive(cached):
        return cached
    override = _own_groups(shape) or {}
    if timeout is not None:
        # every dimension's groups get the timeout (DeviceMesh would give them torch's 30-minute default); a dimension
        # spanning the world under NCCL reuses the default group, which has it already
        for name, size in zip(MESH_DIM_NAMES, shape):
            if size < layout.world_size or name in override:
                override[name] = _options(timeout)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES, backend_override=override or None)
    _MESHES[key] = mesh
    return mesh


EXPERT_MESH_DIM_NAMES = ("pipeline", "expert_data", "expert", "tensor")


def build_expert_mesh(layout: ParallelLayout, device_type: str, timeout: Optional[timedelta] = None) -> DeviceMesh:
    """The mesh expert parallel needs: the data dimension of :func:`build_device_mesh` split into ``expert_data`` x
    ``expert`` (the expert-parallel ranks consecutive in the data dimension, as Megatron orders them). A mesh of its
    own, over the same ranks: torch's ``DeviceMesh._unflatten`` would share the root mesh but is private.

    Example:
        >>> # layout = ParallelLayout.resolve(world_size=4, expert_parallel_size=2, zero_stage=0)
        >>> # mesh = build_expert_mesh(layout, "cpu")
        >>> # mesh["expert"].size()  # -> 2
    """
    ep = layout.expert_parallel_size
    shape = (layout.pipeline_parallel_size, layout.data_parallel_size // ep, ep, layout.tensor_parallel_size)
    return _split_data_mesh(shape, EXPERT_MESH_DIM_NAMES, device_type, timeout)


CONTEXT_MESH_DIM_NAMES = ("pipeline", "replica", "context", "tensor")


def build_context_mesh(layout: ParallelLayout, device_type: str, timeout: Optional[timedelta] = None) -> DeviceMesh:
    """The mesh context parallel needs: the data dimension of :func:`build_device_mesh` split into ``replica`` x
    ``context`` (each replica's context-parallel ranks consecutive, Megatron's tp-cp-dp-pp order), over the same ranks,
    as the expert mesh is; its ``context`` groups carry the all-to-alls of attention (docs/context-parallel.md).

    Example:
        >>> # layout = ParallelLayout.resolve(world_size=4, context_parallel_size=2)
        >>> # build_context_mesh(layout, "cpu")["context"].size()  # -> 2
    """
    shape = (layout.pipeline_parallel_size, layout.data_parallel_size, layout.context_parallel_size,
             layout.tensor_parallel_size)  # fmt: skip
    return _split_data_mesh(shape, CONTEXT_MESH_DIM_NAMES, device_type, timeout)


def _split_data_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], device_type: str, timeout: Optional[timedelta]
) -> DeviceMesh:
    """A 4-D mesh whose middle dimensions split the data dimension (a mesh of its own, over the same ranks: torch's
    ``DeviceMesh._unflatten`` would share the root mesh but is private)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, device_type, dist.get_backend(), timeout, names)
    cached = _MESHES.get(key)
    if cached is not None and _groups_alive(cached, names):
        return cached
    world = dist.get_world_size()
    override = {}
    for name, size in zip(names, shape):
        if dist.get_backend() == "gloo" and size == world:
            override[name] = "gloo"  # a group of its own, not the default group (see _own_groups)
        elif timeout is not None and size < world:
            override[name] = _options(timeout)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)
    _MESHES[key] = mesh
    return mesh


# The mesh of each layout this process built, reused by later fits of the same layout (a notebook, a sweep, a
# `Trainer` per stage): every new mesh makes a process group per dimension, each with its threads (9 per fit under
# gloo), which live until exit and slowed every later step of the process (Lightning's `self.log` took 1.6x as long
# after 5 fits). Every rank builds the same layouts in the same order, so every rank hits or misses alike.
_MESHES: dict[tuple, DeviceMesh] = {}
atexit.register(_MESHES.clear)  # where the script made the default group: its groups are not held into finalization


def _groups_alive(mesh: DeviceMesh, names: tuple[str, ...] = MESH_DIM_NAMES) -> bool:
    """Whether every group of ``mesh`` still exists (a script may have destroyed them, or the default group)."""
    try:
        return all(dist.get_rank(mesh.get_group(name)) >= 0 for name in names)
    except Exception:  # ValueError for a destroyed group (get_world_size would still answer from its cache)
        return False


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


def _options(timeout: timedelta) -> tuple[str, Any]:
    """(backend, options with ``timeout``) for a mesh dimension's groups, on the default group's backend."""
    backend = dist.get_backend()
    return backend, group_options(backend, timeout)


# Lightning's ModelParallelStrategy names its mesh ("data_parallel", "tensor_parallel"); a module written for it slices
# `self.device_mesh` by those names. torch gives a mesh dimension one name only (a flattened alias sliced from the root
# mesh is deprecated since torch 2.11), so the mesh handed out translates them (`with_lightning_names`).
LIGHTNING_DIM_NAMES = {"data_parallel": "data", "tensor_parallel": "tensor", "pipeline_parallel": "pipeline"}


def _canonical(names: Any) -> Any:
    if isinstance(names, str):
        return LIGHTNING_DIM_NAMES.get(names, names)
    if isinstance(names, tuple):
        return tuple(LIGHTNING_DIM_NAMES.get(n, n) if isinstance(n, str) else n for n in names)
    return names


class HybridDeviceMesh(DeviceMesh):
    """The ``("pipeline", "data", "tensor")`` mesh that also answers to Lightning's dimension names: slicing,
    ``get_group`` and ``get_local_rank`` take ``"data_parallel"``/``"tensor_parallel"``/``"pipeline_parallel"`` as
    well. Slices are plain DeviceMeshes with the canonical names; the mesh equals (``==``) the one it views, so
    DTensors built on either agree."""

    def __getitem__(self, mesh_dim_names: Any) -> DeviceMesh:
        return super().__getitem__(_canonical(mesh_dim_names))

    def get_group(self, mesh_dim: Any = None) -> Any:
        return super().get_group(_canonical(mesh_dim))

    def get_local_rank(self, mesh_dim: Any = None) -> int:
        return super().get_local_rank(_canonical(mesh_dim))


def with_lightning_names(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` as a DeviceMesh that also takes Lightning's ``ModelParallelStrategy`` dimension names (a view: the
    same process groups, no collective).

    Example:
        >>> # mesh = with_lightning_names(build_device_mesh(layout, "cpu"))
        >>> # mesh["tensor_parallel"] == mesh["tensor"]  # -> True
    """
    view = object.__new__(HybridDeviceMesh)
    view.__dict__.update(mesh.__dict__)
    return view


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
    """One compact table: the layout, then each rank's (pipeline, data, tensor) coordinates (and its context rank
    under context parallel) and device."""
    head = (
        f"lightning-hybrid: world={layout.world_size}  tp={layout.tensor_parallel_size}"
        f"  pp={layout.pipeline_parallel_size}  dp={layout.data_parallel_size}  zero_stage={layout.zero_stage}"
        f"  sequence_parallel={layout.sequence_parallel}"
        + (f"  cp={layout.context_parallel_size}" if layout.context_parallel_size > 1 else "")
    )
    extras = "  ".join(f"{k}={v}" for k, v in layout.recorded_options().items())
    lines = [head] + ([f"  {extras}"] if extras else [])
    cp = layout.context_parallel_size  # the mesh's data coordinate is replica x cp + context rank
    lines.append(f"  {'rank':>4}  {'pp':>2} {'dp':>2}{' cp' if cp > 1 else ''} {'tp':>2}  device")
    for rank, (host, device, _) in enumerate(rank_devices):
        p, d, t = layout.coordinates(rank)
        context = f" {d % cp:>2}" if cp > 1 else ""
        lines.append(f"  {rank:>4}  {p:>2} {d // cp:>2}{context} {t:>2}  {host}:{device}")
    return "\n".join(lines)


def init_process_groups(cluster_environment: Any, backend: str, device: torch.device, timeout: timedelta) -> None:
    """Start the default process group with ``timeout`` on every collective (a no-op if it exists), with torch's
    flight recorder configured first, and destroy every group at exit.

    Example:
        >>> # init_process_groups(strategy.cluster_environment, "gloo", torch.device("cpu"), timedelta(minutes=10))
    """
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    created = not compat.distributed_is_initialized()
    configure_flight_recorder(backend)  # before the groups exist
    compat.init_dist_connection(cluster_environment, backend, **kwargs)
    if created:
        # Destroy every process group at exit, while the interpreter is still whole. Lightning registers this for
        # NCCL only; a gloo group left to interpreter finalization can abort the finished process ("terminate
        # called without an active exception"): its worker threads release tensors, which takes the GIL, and a
        # thread taking the GIL during finalization is ended by pthread_exit. A no-op if already destroyed.
        atexit.register(_destroy_groups_at_exit)


def _destroy_groups_at_exit() -> None:
    """Destroy every process group, then free what they leave behind (work objects, tensors their threads still
    reference) while the interpreter can still run the destructors, instead of during finalization."""
    import gc

    compat.destroy_dist_connection()
    _MESHES.clear()  # the cached meshes hold their groups: freed here, with the rest, not in finalization
    forget_subgroups()
    gc.collect()


@dataclass(frozen=True)
class Topology:
    """What :func:`start_topology` set up for this process: the strategy keeps it until teardown."""

    layout: ParallelLayout
    mesh: DeviceMesh
    """The ``("pipeline", "data", "tensor")`` mesh, also answering to Lightning's dimension names."""
    data_group: Any
    """The data-parallel process group of this rank (sliced once: slicing a mesh builds a new one)."""
    watchdog: HangWatchdog
    backend: str
    expert_mesh: Optional[DeviceMesh] = None
    """The ``("pipeline", "expert_data", "expert", "tensor")`` mesh under expert parallel (None without)."""
    context_mesh: Optional[DeviceMesh] = None
    """The ``("pipeline", "replica", "context", "tensor")`` mesh under context parallel (None without)."""
    context_group: Any = None
    """This rank's context-parallel group (sliced once; None without context parallel)."""
    context_rank: int = 0
    """This rank's index in its context group: which part of each sample's sequence it keeps."""


def start_topology(
    layout: ParallelLayout, cluster_environment: Any, device: torch.device, backend: Optional[str], timeout: timedelta
) -> Topology:
    """Start the process groups (``backend`` None: Lightning's default for ``device``) with ``timeout`` on every
    collective, build the mesh of ``layout`` with Lightning's dimension names too, start the hang watchdog, and log
    the rank table on rank 0 (gathered from every rank: a collective).

    Example:
        >>> # topology = start_topology(layout, strategy.cluster_environment, device, None, timedelta(minutes=10))
        >>> # topology.mesh["data_parallel"] == topology.mesh["data"]  # -> True
    """
    backend = backend or compat.default_process_group_backend(device)
    compat.ignore_known_warnings()  # again: the filters may have been reset since the import (warnings.catch_warnings)
    init_process_groups(cluster_environment, backend, device, timeout)
    # also answers to the dimension names of Lightning's ModelParallelStrategy ("data_parallel", ...)
    mesh = with_lightning_names(build_device_mesh(layout, device.type, timeout))
    watchdog = HangWatchdog(mesh, timeout, backend)
    watchdog.start()
    expert_mesh = build_expert_mesh(layout, device.type, timeout) if layout.expert_parallel_size > 1 else None
    context_mesh = build_context_mesh(layout, device.type, timeout) if layout.context_parallel_size > 1 else None
    context = context_mesh["context"] if context_mesh is not None else None
    topology = Topology(
        layout=layout, mesh=mesh, data_group=mesh["data"].get_group(), watchdog=watchdog, backend=backend,
        expert_mesh=expert_mesh, context_mesh=context_mesh,
        context_group=context.get_group() if context is not None else None,
        context_rank=context.get_local_rank() if context is not None else 0,
    )  # fmt: skip
    rank_zero_info(format_rank_table(layout, gather_rank_devices(device)))
    return topology


def share_random_state(topology: Optional[Topology], device: torch.device) -> None:
    """Every rank of a replica (its tensor- and pipeline-parallel peers) takes the random state of the replica's first
    rank: they compute one micro-batch together, so a mask or noise the user's step draws must be the same on each
    (docs/step-semantics.md), whatever seed each process was given (``seed_everything(seed + rank)`` gives each its
    own). The data-parallel replicas keep theirs, as under ``"ddp"``. Collective over the world (each replica's group
    is made once, on every rank); one broadcast of the CPU generator's state (and the current CUDA device's) per
    call: at the start of a fit or an evaluation.

    Example:
        >>> # share_random_state(strategy._topology, strategy.root_device)  # every rank, at on_train_start
    """
    if topology is None or topology.mesh.size() == topology.layout.data_parallel_size:
        return
    from lightning_hybrid.process_groups import subgroup

    grid = topology.mesh.mesh  # (pipeline, data, tensor)
    mine = topology.mesh["data"].get_local_rank()
    replicas = [subgroup(grid[:, d, :].flatten().tolist()) for d in range(grid.shape[1])]
    first = int(grid[0, mine, 0])
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device.type == "cuda" else [])
    shared = []
    for state in states:
        buffer = state.to(device)
        dist.broadcast(buffer, src=first, group=replicas[mine])
        shared.append(buffer.cpu())
    torch.set_rng_state(shared[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(shared[1])


def barrier(device: torch.device) -> None:
    """Wait for every rank (nothing to wait for without a process group); NCCL's barrier is told this rank's device.

    Example:
        >>> barrier(torch.device("cpu"))  # no process group: returns at once
    """
    if not compat.distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


T = TypeVar("T")


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (any picklable object; ``obj`` itself without a process group).

    Example:
        >>> broadcast_object({"step": 3})
        {'step': 3}
    """
    if not compat.distributed_is_initialized():
        return obj
    objects = [obj]
    dist.broadcast_object_list(objects, src, group=dist.group.WORLD)
    return objects[0]


def reduce(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (default: every rank) by ``reduce_op`` (``"mean"``, ``"sum"``,
    ``"max"``, ... or a ``ReduceOp``), as Lightning's ``sync_ddp`` does for ``self.log(..., sync_dist=True)``, with one
    collective where it makes two: its barrier before the all-reduce adds a wait, not an order (the all-reduce waits
    for every member itself). A group of one process returns ``tensor`` unchanged with no collective at all.

    Example:
        >>> reduce(torch.tensor([2.0]))  # no process group: nothing to reduce over
        tensor([2.])
    """
    if not compat.distributed_is_initialized():
        return tensor
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if reduce_op is None or isinstance(reduce_op, str):
        reduce_op = dist.ReduceOp.SUM if mean or reduce_op is None else getattr(dist.ReduceOp, reduce_op.upper())
    dist.all_reduce(tensor, op=reduce_op, group=group)
    if not mean:
        return tensor
    # in place, as Lightning's: the logged tensor itself holds the mean afterwards
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
