"""Interception of torch.distributed's (c10d) functions: who is told when a collective or a point-to-point transfer
runs.

The c10d functions (``all_reduce``, ``reduce_scatter_tensor``, ``isend``, ``batch_isend_irecv``, ...) are replaced, in
both of torch's namespaces, by wrappers that tell two kinds of listeners, and are put back when the last one leaves:

- **recorders** (:class:`CollectiveRecorder`, :func:`record_collectives`): every call, its payload bytes and wall
  seconds, and the waits that complete an asynchronous one (``Work.wait()``); the communication meter
  (``monitoring/comm.py``) is one;
- **observers** (:class:`P2PObserver`, :func:`observe_p2p_waits`): when a thread blocks in a point-to-point wait and
  when it returns (torch's flight recorder records collectives under gloo, not ``send``/``recv``); the hang watchdog
  (``watchdog.py``) is one.

A leaf: it knows neither, so the watchdog does not depend on the monitoring code, nor the monitoring code on it.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid._torch_compat import c10d_namespaces
from lightning_hybrid.dtensor import local_bytes

__all__ = [
    "CollectiveRecorder",
    "Key",
    "P2PObserver",
    "observe_p2p_waits",
    "payload_bytes",
    "record",
    "record_collectives",
    "record_time",
]

Key = tuple[str, str]  # (mesh dimension name or "world"/"other", collective name)


def payload_bytes(tensor: Any) -> int:
    """Bytes of this rank's part of a collective's tensor argument (a tensor, or a list of them)."""
    if isinstance(tensor, torch.Tensor):
        return local_bytes(tensor)
    if isinstance(tensor, (list, tuple)):
        return sum(payload_bytes(t) for t in tensor)
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
    """Process-wide: the patches are installed once, however many recorders and observers are active (a benchmark's
    meter and a monitor's can overlap, with the watchdog's observer), and each record goes to every recorder."""

    lock = threading.Lock()
    recorders: list[CollectiveRecorder] = []
    observers: list[P2PObserver] = []
    originals: dict[tuple[Any, str], Any] = {}
    local = threading.local()  # depth of nested c10d calls on this thread (all_gather_object -> all_gather)


def _depth() -> int:
    return getattr(_State.local, "depth", 0)


def record(group: Any, op: str, nbytes: int, seconds: float, peer: Optional[int] = None) -> Optional[Key]:
    """One call of collective ``op`` on ``group`` (``peer``: a point-to-point call's global peer rank), told to every
    recorder; the key it was recorded under (None without recorders), for :func:`record_time` to add its wait to."""
    key = None
    for recorder in list(_State.recorders):
        key = (recorder._dimension_of(group, peer), op)
        recorder._add(key, 1, nbytes, seconds)
    return key


def record_time(key: Optional[Key], seconds: float) -> None:
    """Wait time of an asynchronous collective (its ``wait()``), added to the record :func:`record` made of it."""
    if key is None:
        return
    for recorder in list(_State.recorders):
        recorder._add(key, 0, 0, seconds)


class CollectiveRecorder:
    """Told of every collective while registered with :func:`record_collectives`: calls, bytes and seconds under a key
    of (the dimension it names for the group, collective name). ``CommunicationMeter`` is the one recorder."""

    def _dimension_of(self, group: Any, peer: Optional[int] = None) -> str:
        raise NotImplementedError

    def _add(self, key: Key, calls: int, nbytes: int, seconds: float) -> None:
        raise NotImplementedError


def record_collectives(recorder: CollectiveRecorder, active: bool = True) -> None:
    """Add (or with ``active=False`` remove) a recorder of every collective; the c10d functions are patched while a
    recorder or an observer is active."""
    with _State.lock:
        if active and recorder not in _State.recorders:
            if not _State.recorders and not _State.observers:
                _install()
            _State.recorders.append(recorder)
        elif not active and recorder in _State.recorders:
            _State.recorders.remove(recorder)
            if not _State.recorders and not _State.observers:
                _uninstall()


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
    while a recorder or an observer is active."""
    with _State.lock:
        if active and observer not in _State.observers:
            if not _State.recorders and not _State.observers:
                _install()
            _State.observers.append(observer)
        elif not active and observer in _State.observers:
            _State.observers.remove(observer)
            if not _State.recorders and not _State.observers:
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
            record_time(self._key, time.perf_counter() - start)
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
        if not _State.recorders:
            if _State.observers and self.name in _P2P_NAMES and _depth() == 0:
                return self._observed(args, kwargs)
            return self.original(*args, **kwargs)
        bound = self._arguments(args, kwargs)
        payload = _C10D_PAYLOAD.get(self.name)
        nbytes = payload_bytes(bound.get(payload)) if payload else 0
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
        key = record(bound.get("group"), _P2P_NAMES.get(self.name, self.name), nbytes, seconds, peer)
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
        if _depth() > 0 or not (_State.recorders or _State.observers):
            return original(p2p_op_list)
        if not _State.recorders:  # observers only: each op's wait (one work per op, or one for a coalesced batch)
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
            keys.append(record(p2p.group, op, payload_bytes(p2p.tensor), seconds / max(1, len(p2p_op_list)), p2p.peer))
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
