"""Count every collective a 3D run issues: calls, bytes and wall seconds per (mesh dimension, collective).

Three paths carry the traffic of a hybrid run, and the meter sees all of them:

1. ``torch.distributed`` (c10d) functions: ZeRO 0-2 reductions, FSDP2's all-gather/reduce-scatter (ZeRO-3), the
   pipeline's ``isend``/``irecv``/``batch_isend_irecv``, Lightning's own ``all_reduce``/``broadcast``.
2. DTensor's functional collectives (``torch.ops._c10d_functional.*``: tensor parallel, the vocabulary-parallel loss),
   seen through a ``TorchDispatchMode``.
3. The waits that complete asynchronous ones (``Work.wait()``, ``wait_tensor``) are added to the collective they
   finish, so an asynchronous send costs what it really blocked the caller for.

The c10d functions and their ``Work.wait()`` are seen through the c10d interception
(``lightning_hybrid/c10d_interception.py``), whose patches also tell the hang watchdog when a thread blocks in a
point-to-point wait; the functional collectives and ``wait_tensor`` through this module's dispatch mode.

Time is host wall time. On CUDA (NCCL) a collective call only enqueues a kernel and returns: the seconds measure the
launch (and blocking waits) unless the caller synchronizes; on CPU (gloo) they are the transfer itself.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid._torch_compat import AsyncCollectiveTensor, TorchDispatchMode, op_name, resolve_process_group
from lightning_hybrid.c10d_interception import (
    CollectiveRecorder,
    Key,
    payload_bytes,
    record,
    record_collectives,
    record_time,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CommunicationMeter", "Stat"]


@dataclass
class Stat:
    """What one (dimension, collective) pair cost while a meter was active.

    ``bytes`` is the collective's full buffer on this rank: the tensor for all-reduce/broadcast/send/recv, the
    gathered output for all-gather, the unreduced input for reduce-scatter (the convention of nccl-tests' "size").
    """

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


# Functional collectives (DTensor): op name -> bytes of the full buffer from (args)
def _functional_bytes(name: str, args: tuple) -> int:
    first = args[0]
    if name.startswith("all_gather_into_tensor"):
        group_size = args[1]
        return payload_bytes(first) * group_size
    return payload_bytes(first)


def _functional_group(name: str, args: tuple) -> Any:
    return args[-1]  # every _c10d_functional collective takes its group (name or object) last


def _deferred_subclasses() -> tuple[type, ...]:
    from torch.distributed.tensor import DTensor

    return (DTensor, AsyncCollectiveTensor)


_DEFERRED = _deferred_subclasses()


class _FunctionalCollectiveMode(TorchDispatchMode):
    """Sees ``_c10d_functional`` ops (DTensor redistribution, funcol) and their ``wait_tensor``. Ops on tensor
    subclasses (DTensor, AsyncCollectiveTensor) are handed back to the subclass so that the collectives it issues
    come through this mode as plain-tensor ops (the way torch's ``CommDebugMode`` does it)."""

    NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
    COLLECTIVES = frozenset({
        "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor",
        "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
        "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
        "broadcast_", "isend", "irecv", "batch_p2p_ops",
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, Key] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(t in _DEFERRED for t in types):
            return NotImplemented
        name = op_name(func)
        collective = name in self.COLLECTIVES or name == "wait_tensor"
        if getattr(func, "namespace", "") not in self.NAMESPACES or not collective:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        if name == "wait_tensor":
            record_time(self._pending.pop(id(args[0]), None), seconds)
            return out
        if name in ("isend", "irecv", "batch_p2p_ops"):
            op = {"isend": "send", "irecv": "recv"}.get(name, name)
            key = record(_functional_group(name, args), op, payload_bytes(args[0]), seconds)
        else:
            key = record(_functional_group(name, args), name.removesuffix("_"), _functional_bytes(name, args), seconds)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor) and key is not None:
                self._pending[id(tensor)] = key
        return out


class CommunicationMeter(CollectiveRecorder):
    """Counts calls, bytes and wall seconds of every collective issued while active, per (dimension, collective).

    The dimension is the name of the mesh dimension whose process group the collective ran on (``"tensor"``,
    ``"pipeline"``, ``"data"``, and ``"expert"`` for expert parallel's all-to-all), ``"world"`` for the default
    group, ``"other"`` for any other group. Point-to-point calls on the default group are attributed by their peer
    (a pipeline neighbour is ``"pipeline"``).

    Arguments:
        device_mesh: the run's mesh (``strategy.device_mesh``); without one, every group is ``"world"``/``"other"``.
        expert_mesh: expert parallel's mesh (``("pipeline", "expert_data", "expert", "tensor")``), when there is
            one: its ``expert`` groups are ``"expert"``, and the expert weights' reductions over ``expert_data``
            are data-parallel traffic, ``"data"``.
        functional_collectives: also intercept DTensor's functional collectives through a ``TorchDispatchMode``
            (every aten op then passes through Python: keep it on for measured steps only).

    Seconds are host wall time: on CUDA a collective only enqueues work, so they measure launch plus blocking waits
    unless the stream is synchronized; on CPU (gloo) they include the transfer.

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
        self._lock = threading.Lock()
        self._mode: Optional[_FunctionalCollectiveMode] = None
        self._group_names: dict[str, str] = {}  # group name -> mesh dimension
        self._rank_sets: list[tuple[frozenset[int], str]] = []
        self._active = False

    # ------------------------------------------------------------------ public
    def __enter__(self) -> CommunicationMeter:
        self._index_groups()
        record_collectives(self)
        self._active = True
        if self.functional_collectives:
            self._mode = _FunctionalCollectiveMode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        record_collectives(self, active=False)
        self._active = False

    def reset(self) -> None:
        """Forget everything counted so far (the meter stays active)."""
        with self._lock:
            self._stats.clear()

    def totals(self) -> dict[Key, Stat]:
        """``{(dimension, collective): Stat(calls, bytes, seconds)}`` since the start or the last ``reset``."""
        with self._lock:
            return {k: Stat(v.calls, v.bytes, v.seconds) for k, v in self._stats.items()}

    def bytes_by_dimension(self) -> dict[str, int]:
        """Bytes per mesh dimension, all collectives together."""
        out: dict[str, int] = defaultdict(int)
        for (dim, _), stat in self.totals().items():
            out[dim] += stat.bytes
        return dict(out)

    def seconds_by_dimension(self) -> dict[str, float]:
        """Wall seconds per mesh dimension, all collectives together."""
        out: dict[str, float] = defaultdict(float)
        for (dim, _), stat in self.totals().items():
            out[dim] += stat.seconds
        return dict(out)

    def calls_by_dimension(self) -> dict[str, int]:
        """Calls per mesh dimension, all collectives together."""
        out: dict[str, int] = defaultdict(int)
        for (dim, _), stat in self.totals().items():
            out[dim] += stat.calls
        return dict(out)

    # ------------------------------------------------------------------ internals
    def _add(self, key: Key, calls: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            stat = self._stats[key]
            stat.calls += calls
            stat.bytes += nbytes
            stat.seconds += seconds

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
