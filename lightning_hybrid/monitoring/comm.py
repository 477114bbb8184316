"""Count every collective a 3D run issues: calls, bytes and wall seconds per (mesh dimension, collective).

Three paths carry the traffic of a hybrid run, and the meter sees all of them:

1. ``torch.distributed`` (c10d) functions: ZeRO 0-2 reductions, FSDP2's all-gather/reduce-scatter (ZeRO-3), the
   pipeline's ``isend``/``irecv``/``batch_isend_irecv``, Lightning's own ``all_reduce``/``broadcast``.
2. DTensor's functional collectives (``torch.ops._c10d_functional.*``: tensor parallel, the vocabulary-parallel loss),
   seen through a ``TorchDispatchMode``.
3. The waits that complete asynchronous ones (``Work.wait()``, ``wait_tensor``) are added to the collective they
   finish, so an asynchronous send costs what it really blocked the caller for.

The same patches tell observers (the hang watchdog, ``lightning_hybrid.watchdog``) when a thread blocks in a
point-to-point wait and when it returns: torch's flight recorder records collectives under gloo, not ``send``/``recv``.

Time is host wall time. On CUDA (NCCL) a collective call only enqueues a kernel and returns: the seconds measure the
launch (and blocking waits) unless the caller synchronizes; on CPU (gloo) they are the transfer itself.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid._torch_compat import (
    AsyncCollectiveTensor,
    TorchDispatchMode,
    c10d_namespaces,
    op_name,
    resolve_process_group,
)
from lightning_hybrid.dtensor import local_bytes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CommunicationMeter", "P2PObserver", "Stat", "observe_p2p_waits"]

Key = tuple[str, str]  # (mesh dimension name or "world"/"other", collective name)


@dataclass
class Stat:
    """What one (dimension, collective) pair cost while a meter was active.

    ``bytes`` is the collective's full buffer on this rank: the tensor for all-reduce/broadcast/send/recv, the
    gathered output for all-gather, the unreduced input for reduce-scatter (the convention of nccl-tests' "size").
    """

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return local_bytes(tensor)
    if isinstance(tensor, (list, tuple)):
        return sum(_nbytes(t) for t in tensor)
    return 0


# c10d functions: name -> (argument that carries the payload, how to size it). Functions that serialize objects
# (all_gather_object, ...) have no tensor argument: their bytes are those of the tensor collectives they run inside.
_C10D_PAYLOAD: dict[str, Optional[str]] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
    "all_reduce_coalesced": "tensors",
    "monitored_barrier": None,
}
_P2P_NAMES = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class _State:
    """Process-wide: the patches are installed once, however many meters are active (a benchmark's and a
    monitor's can overlap), and each record goes to every active meter."""

    lock = threading.Lock()
    meters: list[CommunicationMeter] = []
    observers: list[P2PObserver] = []
    originals: dict[tuple[Any, str], Any] = {}
    local = threading.local()  # depth of nested c10d calls on this thread (all_gather_object -> all_gather)


def _depth() -> int:
    return getattr(_State.local, "depth", 0)


def _record(group: Any, op: str, nbytes: int, seconds: float, peer: Optional[int] = None) -> Optional[Key]:
    key = None
    for meter in list(_State.meters):
        key = (meter._dimension_of(group, peer), op)
        meter._add(key, 1, nbytes, seconds)
    return key


def _record_time(key: Optional[Key], seconds: float) -> None:
    if key is None:
        return
    for meter in list(_State.meters):
        meter._add(key, 0, 0, seconds)


class P2PObserver:
    """Told when a thread blocks in a point-to-point transfer (a blocking ``send``/``recv``, or ``wait()`` on the
    ``Work`` of ``isend``/``irecv``/``batch_isend_irecv``) and when it returns. Calls come on the waiting thread:
    keep them to a few dictionary operations."""

    def p2p_wait_begin(self, op: str, group: Any, peer: Optional[int]) -> Any:
        """``op`` is ``"send"`` or ``"recv"``, ``peer`` the global rank; returns a token for ``p2p_wait_end``."""
        raise NotImplementedError

    def p2p_wait_end(self, token: Any, failed: bool) -> None:
        """``failed``: the wait raised (a timeout, a peer gone)."""
        raise NotImplementedError


P2P = tuple[str, Any, Optional[int]]  # (op, group, global peer rank) of a point-to-point transfer


def observe_p2p_waits(observer: P2PObserver, active: bool = True) -> None:
    """Add (or with ``active=False`` remove) an observer of point-to-point waits; the c10d functions are patched
    while a meter or an observer is active."""
    with _State.lock:
        if active and observer not in _State.observers:
            if not _State.meters and not _State.observers:
                _install()
            _State.observers.append(observer)
        elif not active and observer in _State.observers:
            _State.observers.remove(observer)
            if not _State.meters and not _State.observers:
                _uninstall()


def _begin(p2p: Optional[P2P]) -> list[tuple[P2PObserver, Any]]:
    if p2p is None:
        return []
    return [(o, o.p2p_wait_begin(*p2p)) for o in list(_State.observers)]


def _end(tokens: list[tuple[P2PObserver, Any]], failed: bool) -> None:
    for observer, token in tokens:
        observer.p2p_wait_end(token, failed)


def _p2p_of(name: str, bound: dict[str, Any]) -> Optional[P2P]:
    """(op, group, global peer) of a c10d point-to-point call, None for collectives or without observers."""
    if name not in _P2P_NAMES or not _State.observers:
        return None
    group = bound.get("group")
    peer = bound.get("dst", bound.get("src"))
    if peer is None:
        group_peer = bound.get("group_dst", bound.get("group_src"))
        if group_peer is not None:
            try:
                peer = dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)
            except Exception:
                peer = None
    return _P2P_NAMES[name], group, peer


class _TimedWork(dist.Work):
    """The ``Work`` of an asynchronous collective, timing ``wait()`` into the collective's entry (and telling the
    point-to-point observers). A subclass of ``dist.Work`` because FSDP2 checks ``isinstance(work, Work)`` before
    waiting."""

    def __init__(self, inner: dist.Work, key: Optional[Key], p2p: Optional[P2P] = None) -> None:
        super().__init__()
        self._inner, self._key, self._p2p = inner, key, p2p

    def wait(self, timeout: Any = None) -> bool:
        tokens = _begin(self._p2p)
        start, failed = time.perf_counter(), True
        try:
            done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
            failed = False
            return done
        finally:
            _record_time(self._key, time.perf_counter() - start)
            _end(tokens, failed)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def get_future(self) -> Any:
        return self._inner.get_future()

    def result(self) -> Any:
        return self._inner.result()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def synchronize(self) -> None:
        self._inner.synchronize()


def _wrap_work(result: Any, key: Optional[Key], p2p: Optional[P2P] = None) -> Any:
    wrap = isinstance(result, dist.Work) and (key is not None or p2p is not None)
    return _TimedWork(result, key, p2p) if wrap else result


class _Patched:
    """A c10d function that records itself. Compares and hashes equal to the original: torch checks
    ``op in [isend, irecv]`` on ``P2POp`` and ``{p.op for p in ops} == {dist.isend}`` in the pipeline schedules,
    and ops built before or after the patch must still match."""

    def __init__(self, name: str, original: Callable) -> None:
        self.name, self.original = name, original
        self.signature = inspect.signature(original)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = list(self.signature.parameters.values())
        # names of the leading positional parameters: binding by zip takes about 1 us a call, Signature.bind_partial
        # about 5 (it runs on every send/recv of the pipeline, per micro-batch, while the watchdog observes)
        self._positional = [p.name for p in params if p.kind in kinds]
        self._simple = all(p.kind in (*kinds, inspect.Parameter.KEYWORD_ONLY) for p in params)
        functools.update_wrapper(self, original)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name (those given; defaults are not filled in, as ``bind_partial``)."""
        if not self._simple or len(args) > len(self._positional):
            return dict(self.signature.bind_partial(*args, **kwargs).arguments)
        bound = dict(zip(self._positional, args))
        bound.update(kwargs)
        return bound

    def __eq__(self, other: object) -> bool:
        original = other.original if isinstance(other, _Patched) else other
        return original is self.original

    def __hash__(self) -> int:
        return hash(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _State.meters:
            if _State.observers and self.name in _P2P_NAMES and _depth() == 0:
                return self._observed(args, kwargs)
            return self.original(*args, **kwargs)
        bound = self._arguments(args, kwargs)
        payload = _C10D_PAYLOAD.get(self.name)
        nbytes = _nbytes(bound.get(payload)) if payload else 0
        if _depth() > 0:  # inside another collective (all_gather_object -> all_gather): its bytes go to the outer one
            _State.local.nested_bytes += nbytes
            return self.original(*args, **kwargs)
        peer = None
        if self.name in _P2P_NAMES:
            peer = bound.get("dst", bound.get("src"))
        p2p = _p2p_of(self.name, bound)
        blocking = p2p is not None and self.name in ("send", "recv")
        tokens = _begin(p2p) if blocking else []
        _State.local.depth, _State.local.nested_bytes = 1, 0
        start, failed = time.perf_counter(), True
        try:
            result = self.original(*args, **kwargs)
            failed = False
        finally:
            _State.local.depth = 0
            seconds = time.perf_counter() - start
            _end(tokens, failed)
        nbytes = nbytes if payload else _State.local.nested_bytes
        key = _record(bound.get("group"), _P2P_NAMES.get(self.name, self.name), nbytes, seconds, peer)
        return _wrap_work(result, key, None if blocking else p2p)

    def _observed(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A point-to-point call while only observers are active: no metering, just the wait."""
        p2p = _p2p_of(self.name, self._arguments(args, kwargs))
        if self.name in ("send", "recv"):  # blocking: the call itself is the wait
            tokens, failed = _begin(p2p), True
            try:
                # torch's send/recv are isend/irecv + wait: that inner call is this one, not observed again
                result = _unobserved(self.original, *args, **kwargs)
                failed = False
                return result
            finally:
                _end(tokens, failed)
        return _wrap_work(self.original(*args, **kwargs), None, p2p)


def _unobserved(call: Callable, *args: Any, **kwargs: Any) -> Any:
    """``call`` with the c10d calls it makes inside passed straight through (depth 1), for a call observed as one."""
    _State.local.depth = 1
    try:
        return call(*args, **kwargs)
    finally:
        _State.local.depth = 0


def _patched_batch_isend_irecv(original: Callable) -> Callable:
    """Each ``P2POp`` of the batch is one ``send``/``recv`` call (its own bytes, its own wait)."""

    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        if _depth() > 0 or not (_State.meters or _State.observers):
            return original(p2p_op_list)
        if not _State.meters:  # observers only: each op's wait (one work per op, or one for a coalesced batch)
            # the isend/irecv calls inside are this batch's, observed here once, at their waits
            works = _unobserved(original, p2p_op_list)
            if not isinstance(works, list):
                return works
            p2ps = [_batch_p2p(p2p) for p2p in p2p_op_list]
            return [_wrap_work(w, None, p2ps[min(i, len(p2ps) - 1)]) for i, w in enumerate(works)]
        _State.local.depth, _State.local.nested_bytes = 1, 0
        start = time.perf_counter()
        try:
            works = original(p2p_op_list)
        finally:
            _State.local.depth = 0
            seconds = time.perf_counter() - start
        keys, p2ps = [], []
        for p2p in p2p_op_list:
            op = "send" if getattr(p2p.op, "__name__", "") == "isend" else "recv"
            keys.append(_record(p2p.group, op, _nbytes(p2p.tensor), seconds / max(1, len(p2p_op_list)), p2p.peer))
            p2ps.append(_batch_p2p(p2p))
        if isinstance(works, list) and len(works) == len(keys):
            return [_wrap_work(w, k, o) for w, k, o in zip(works, keys, p2ps)]
        if isinstance(works, list):
            return [_wrap_work(w, keys[0] if keys else None, p2ps[0] if p2ps else None) for w in works]
        return works

    return batch_isend_irecv


def _batch_p2p(p2p: Any) -> Optional[P2P]:
    """(op, group, global peer) of one ``P2POp`` of a batch, None without observers."""
    if not _State.observers:
        return None
    return ("send" if getattr(p2p.op, "__name__", "") == "isend" else "recv"), p2p.group, p2p.peer


def _install() -> None:
    namespaces = c10d_namespaces()
    c10d = namespaces[0]

    # Both namespaces: torch's own helpers call the module globals (all_gather_object -> all_gather), users and
    # Lightning call torch.distributed.*.
    for name in _C10D_PAYLOAD:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        patched = _Patched(name, original)
        for module in namespaces:
            if getattr(module, name, None) is original:
                _State.originals[(module, name)] = original
                setattr(module, name, patched)
    for module in namespaces:
        original = getattr(module, "batch_isend_irecv", None)
        if original is not None:
            _State.originals[(module, "batch_isend_irecv")] = original
            module.batch_isend_irecv = _patched_batch_isend_irecv(original)


def _uninstall() -> None:
    for (module, name), original in _State.originals.items():
        setattr(module, name, original)
    _State.originals.clear()


# Functional collectives (DTensor): op name -> bytes of the full buffer from (args)
def _functional_bytes(name: str, args: tuple) -> int:
    first = args[0]
    if name.startswith("all_gather_into_tensor"):
        group_size = args[1]
        return _nbytes(first) * group_size
    return _nbytes(first)


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
            _record_time(self._pending.pop(id(args[0]), None), seconds)
            return out
        if name in ("isend", "irecv", "batch_p2p_ops"):
            op = {"isend": "send", "irecv": "recv"}.get(name, name)
            key = _record(_functional_group(name, args), op, _nbytes(args[0]), seconds)
        else:
            key = _record(_functional_group(name, args), name.removesuffix("_"), _functional_bytes(name, args), seconds)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor) and key is not None:
                self._pending[id(tensor)] = key
        return out


class CommunicationMeter:
    """Counts calls, bytes and wall seconds of every collective issued while active, per (dimension, collective).

    The dimension is the name of the mesh dimension whose process group the collective ran on (``"tensor"``,
    ``"pipeline"``, ``"data"``), ``"world"`` for the default group, ``"other"`` for any other group. Point-to-point
    calls on the default group are attributed by their peer (a pipeline neighbour is ``"pipeline"``).

    Arguments:
        device_mesh: the run's mesh (``strategy.device_mesh``); without one, every group is ``"world"``/``"other"``.
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

    def __init__(self, device_mesh: Optional[DeviceMesh] = None, *, functional_collectives: bool = True) -> None:
        self.device_mesh = device_mesh
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
        with _State.lock:
            if not _State.meters and not _State.observers:
                _install()
            _State.meters.append(self)
        self._active = True
        if self.functional_collectives:
            self._mode = _FunctionalCollectiveMode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        with _State.lock:
            if self in _State.meters:
                _State.meters.remove(self)
            if not _State.meters and not _State.observers:
                _uninstall()
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
        mesh = self.device_mesh
        if mesh is not None and mesh.mesh_dim_names:
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name)
                self._group_names[group.group_name] = name
                # a 1-rank dimension is never a transport; sorted smallest first below, so a peer's link is the
                # smallest dimension holding both ranks
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
