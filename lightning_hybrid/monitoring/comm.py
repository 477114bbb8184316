"""Count every collective a 3D run issues: calls, bytes and wall seconds per (mesh dimension, collective).

The meter is a ``TorchDispatchMode`` (the way torch's own ``CommDebugMode`` counts): while it is active on a thread,
every ATen operation the thread runs passes through it, and with them the two kinds of operation a collective is:

1. ``torch.ops.c10d.*``, the operations every ``torch.distributed`` function dispatches to (ZeRO's reductions,
   FSDP2's all-gather/reduce-scatter, the pipeline schedules' ``isend``/``irecv``, Lightning's and the user's own
   collectives);
2. ``torch.ops._c10d_functional.*``, DTensor's functional collectives (tensor parallel, the vocabulary-parallel loss,
   expert parallel's all-to-all), with their ``wait_tensor``.

Nothing of torch is replaced: the ``torch.distributed`` functions, the ``Work`` objects they return and a user's own
calls are untouched; the mode only reads the arguments (the process group, the buffers) and hands every operation on.

Seconds are each collective's time in flight: from its call until the meter saw it complete, which it checks after
each operation the thread runs (``Work.is_completed()`` of a c10d operation, the ``wait_tensor`` of a functional one);
an asynchronous collective counts while it runs behind other work, and collectives that overlap count once per
dimension (the union of their intervals). On CPU (gloo) that is the transfer itself, waiting for late peers included;
on CUDA (NCCL) it is up to the kernel's completion as the host sees it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid._torch_compat import (
    AsyncCollectiveTensor,
    TorchDispatchMode,
    op_argument_names,
    op_name,
    resolve_process_group,
    unboxed_process_group,
    unboxed_work,
)
from lightning_hybrid.dtensor import local_bytes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CommunicationMeter", "Stat"]

Key = tuple[str, str]  # (mesh dimension name or "world"/"other", collective name)


@dataclass
class Stat:
    """What one (dimension, collective) pair cost while a meter was active.

    ``bytes`` is the collective's full buffer on this rank: the tensor for all-reduce/broadcast/send/recv, the
    gathered output for all-gather, the unreduced input for reduce-scatter (the convention of nccl-tests' "size").
    ``seconds``: the wall time during which at least one of these calls was in flight.
    """

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


def payload_bytes(tensor: Any) -> int:
    """Bytes of this rank's part of a collective's tensor argument (a tensor, or a list of them, nested).

    Example:
        >>> payload_bytes([torch.zeros(2), [torch.zeros(3, dtype=torch.float64)]])
        32
    """
    if isinstance(tensor, torch.Tensor):
        return local_bytes(tensor)
    if isinstance(tensor, (list, tuple)):
        return sum(payload_bytes(t) for t in tensor)
    return 0


# c10d operation -> (collective name as torch.distributed calls it, index of the argument whose bytes it counts, or
# None for none); every c10d operation takes its process group as the argument named ``process_group``
_C10D: dict[str, tuple[str, Optional[int]]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "_allgather_base_": ("all_gather_into_tensor", 0),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor", 1),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all_single", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
_P2P_PEER = {"send": "dst", "recv_": "src"}  # the argument naming a point-to-point call's peer (a group rank)
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_FUNCTIONAL = frozenset({
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
    "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
    "broadcast_",
})  # fmt: skip


def _deferred_subclasses() -> tuple[type, ...]:
    from torch.distributed.tensor import DTensor

    return (DTensor, AsyncCollectiveTensor)


_DEFERRED = _deferred_subclasses()


class _Operation:
    """How the meter reads one ATen operation (worked out once per operation, then looked up)."""

    __slots__ = ("kind", "name", "payload", "group", "peer")

    def __init__(self, func: Any) -> None:
        namespace, op = getattr(func, "namespace", ""), op_name(func)
        self.kind, self.name, self.payload, self.group, self.peer = "", op, None, -1, -1
        if namespace == "c10d" and op in _C10D:
            self.kind = "c10d"
            self.name, self.payload = _C10D[op]
            names = op_argument_names(func)
            self.group = names.index("process_group")
            self.peer = names.index(_P2P_PEER[op]) if op in _P2P_PEER else -1
        elif namespace in _FUNCTIONAL_NAMESPACES and op == "wait_tensor":
            self.kind = "wait"
        elif namespace in _FUNCTIONAL_NAMESPACES and op in _FUNCTIONAL:
            self.kind, self.name = "functional", op.removesuffix("_")


class _CollectiveMode(TorchDispatchMode):
    """Hands every operation on, noting the collectives. Operations on tensor subclasses (DTensor,
    AsyncCollectiveTensor) go back to the subclass first, so that the collectives it issues come through here as
    plain-tensor operations (as torch's ``CommDebugMode`` does)."""

    def __init__(self, meter: CommunicationMeter) -> None:
        super().__init__()
        self.meter = meter
        self._operations: dict[Any, _Operation] = {}
        self._works: list[tuple[Any, Key, float]] = []  # c10d works in flight: (work, key, start)
        self._tensors: dict[int, tuple[Key, float]] = {}  # functional collectives' outputs, until their wait

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(t in _DEFERRED for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        operation = self._operations.get(func)
        if operation is None:
            operation = self._operations[func] = _Operation(func)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if operation.kind == "c10d":
            self._c10d(operation, args, out, start)
        elif operation.kind == "functional":
            self._functional(operation, args, out, start)
        elif operation.kind == "wait":
            pending = self._tensors.pop(id(args[0]), None)
            if pending is not None:
                self.meter._interval(pending[0], pending[1], time.perf_counter())
        if self._works:
            self.poll()
        return out

    def _c10d(self, operation: _Operation, args: tuple, out: Any, start: float) -> None:
        group = unboxed_process_group(args[operation.group])
        peer = None
        if operation.peer >= 0:
            peer = dist.get_global_rank(group, args[operation.peer])
        nbytes = payload_bytes(args[operation.payload]) if operation.payload is not None else 0
        key = (self.meter._dimension_of(group, peer), operation.name)
        self.meter._count(key, nbytes)
        boxed = out[-1] if isinstance(out, tuple) and out else out
        work = unboxed_work(boxed) if isinstance(boxed, torch.ScriptObject) else None
        if work is None:  # returned nothing to wait on (a monitored barrier): done when the call returned
            self.meter._interval(key, start, time.perf_counter())
        else:
            self._works.append((work, key, start))

    def _functional(self, operation: _Operation, args: tuple, out: Any, start: float) -> None:
        if not self.meter.functional_collectives:
            return
        nbytes = payload_bytes(args[0])
        if operation.name.startswith("all_gather_into_tensor"):
            nbytes *= args[1]  # the gathered output: the input times the group size
        key = (self.meter._dimension_of(args[-1]), operation.name)
        self.meter._count(key, nbytes)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self._tensors[id(tensor)] = (key, start)

    def forget(self) -> None:
        """Stop following the collectives in flight (the meter was reset)."""
        self._works, self._tensors = [], {}

    def open_intervals(self) -> list[tuple[Key, float]]:
        """(key, start) of the collectives still in flight."""
        return [(key, start) for _, key, start in self._works] + list(self._tensors.values())

    def poll(self, final: bool = False) -> None:
        """Close the interval of every c10d collective seen complete (of every one still open, when ``final``)."""
        now, still = time.perf_counter(), []
        for work, key, start in self._works:
            if final or work.is_completed():
                self.meter._interval(key, start, now)
            else:
                still.append((work, key, start))
        self._works = still
        if final:
            for key, begun in self._tensors.values():
                self.meter._interval(key, begun, now)
            self._tensors = {}


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``intervals``.

    Example:
        >>> _union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
        4.0
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class CommunicationMeter:
    """Counts calls, bytes and wall seconds of every collective issued while active, per (dimension, collective).

    The dimension is the name of the mesh dimension whose process group the collective ran on (``"tensor"``,
    ``"pipeline"``, ``"data"``, and ``"expert"`` for expert parallel's all-to-all), ``"world"`` for the default
    group, ``"other"`` for any other group. Point-to-point calls on the default group are attributed by their peer
    (a pipeline neighbour is ``"pipeline"``). The collective's name is the ``torch.distributed`` function's
    (``all_reduce``, ``reduce_scatter_tensor``, ``send``, ...); an object collective (``all_gather_object``) counts
    as the tensor collectives it runs.

    Arguments:
        device_mesh: the run's mesh (``strategy.device_mesh``); without one, every group is ``"world"``/``"other"``.
        expert_mesh: expert parallel's mesh (``("pipeline", "expert_data", "expert", "tensor")``), when there is
            one: its ``expert`` groups are ``"expert"``, and the expert weights' reductions over ``expert_data``
            are data-parallel traffic, ``"data"``.
        functional_collectives: also count DTensor's functional collectives (the default).

    While active, every ATen operation of the thread that entered it passes through Python (a
    ``TorchDispatchMode``): keep it on for measured steps only. Only that thread's collectives are seen.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from lightning_hybrid.monitoring import CommunicationMeter
        >>> with CommunicationMeter() as meter:  # doctest: +SKIP
        ...     dist.all_reduce(torch.ones(1024))  # 4096 bytes on the default group
        >>> meter.totals()[("world", "all_reduce")].bytes  # doctest: +SKIP
        4096
    """

    def __init__(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        *,
        expert_mesh: Optional[DeviceMesh] = None,
        functional_collectives: bool = True,
    ) -> None:
        self.device_mesh = device_mesh
        self.expert_mesh = expert_mesh
        self.functional_collectives = functional_collectives
        self._stats: dict[Key, Stat] = defaultdict(Stat)
        self._intervals: dict[Key, list[tuple[float, float]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._mode: Optional[_CollectiveMode] = None
        self._group_names: dict[str, str] = {}  # group name -> mesh dimension
        self._rank_sets: list[tuple[frozenset[int], str]] = []

    # ------------------------------------------------------------------ public
    def __enter__(self) -> CommunicationMeter:
        self._index_groups()
        self._mode = _CollectiveMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode.poll(final=True)
            self._mode = None

    def reset(self) -> None:
        """Forget everything counted so far (the meter stays active)."""
        with self._lock:
            self._stats.clear()
            self._intervals.clear()
        if self._mode is not None:  # what is in flight was counted before the reset
            self._mode.forget()

    def totals(self) -> dict[Key, Stat]:
        """``{(dimension, collective): Stat(calls, bytes, seconds)}`` since the start or the last ``reset``; a
        collective still in flight counts until now."""
        intervals = self._current_intervals()
        with self._lock:
            return {k: Stat(v.calls, v.bytes, _union(intervals.get(k, []))) for k, v in self._stats.items()}

    def bytes_by_dimension(self) -> dict[str, int]:
        """Bytes per mesh dimension, all collectives together."""
        out: dict[str, int] = defaultdict(int)
        for (dim, _), stat in self.totals().items():
            out[dim] += stat.bytes
        return dict(out)

    def seconds_by_dimension(self) -> dict[str, float]:
        """Wall seconds per mesh dimension during which at least one of its collectives was in flight."""
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (dim, _), intervals in self._current_intervals().items():
            spans[dim].extend(intervals)
        return {dim: _union(intervals) for dim, intervals in spans.items()}

    def calls_by_dimension(self) -> dict[str, int]:
        """Calls per mesh dimension, all collectives together."""
        out: dict[str, int] = defaultdict(int)
        for (dim, _), stat in self.totals().items():
            out[dim] += stat.calls
        return dict(out)

    # ------------------------------------------------------------------ internals
    def _current_intervals(self) -> dict[Key, list[tuple[float, float]]]:
        """Every interval so far, those still open ending now."""
        mode = self._mode
        if mode is not None:
            mode.poll()
        now = time.perf_counter()
        with self._lock:
            intervals = {k: list(v) for k, v in self._intervals.items()}
        for key, start in mode.open_intervals() if mode is not None else []:
            intervals.setdefault(key, []).append((start, now))
        return intervals

    def _count(self, key: Key, nbytes: int) -> None:
        with self._lock:
            stat = self._stats[key]
            stat.calls += 1
            stat.bytes += nbytes

    def _interval(self, key: Key, start: float, end: float) -> None:
        with self._lock:
            self._intervals[key].append((start, end))

    def _index_groups(self) -> None:
        # keyed by group name, never by the group: a meter lives as long as its callback, and a process group held
        # past ``destroy_process_group`` keeps its gloo threads running into interpreter exit (see topology.py)
        self._group_names.clear()
        self._rank_sets.clear()
        if not (dist.is_available() and dist.is_initialized()):
            return
        for mesh, renamed in ((self.device_mesh, {}), (self.expert_mesh, {"expert_data": "data"})):
            if mesh is None or not mesh.mesh_dim_names:
                continue
            for dimension in mesh.mesh_dim_names:
                group, name = mesh.get_group(dimension), renamed.get(dimension, dimension)
                self._group_names[group.group_name] = name
                # a 1-rank dimension is never a transport; sorted smallest first below, so a peer's link is the
                # smallest dimension holding both ranks (the main mesh's first where the expert mesh's has the same
                # ranks: the sort is stable)
                self._rank_sets.append((frozenset(dist.get_process_group_ranks(group)), name))
        self._group_names.setdefault(dist.group.WORLD.group_name, "world")
        self._rank_sets.sort(key=lambda item: len(item[0]))

    def _dimension_of(self, group: Any, peer: Optional[int] = None) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            group = dist.group.WORLD
        key = group if isinstance(group, str) else getattr(group, "group_name", None)
        name = self._group_names.get(key) if key is not None else None
        if name is None:
            try:
                if isinstance(group, str):
                    group = resolve_process_group(group)
                ranks = frozenset(dist.get_process_group_ranks(group))
            except Exception:
                return "other"
            name = next((n for s, n in self._rank_sets if s == ranks), "other")
            if key is not None:
                self._group_names[key] = name
        if name == "world" and peer is not None:
            # a send/recv on the default group: the smallest mesh dimension holding both ranks names the link
            me = dist.get_rank()
            return next((n for s, n in self._rank_sets if len(s) > 1 and me in s and peer in s), "world")
        return name
