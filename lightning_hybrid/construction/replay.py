"""Replay a recorded construction on a real device, one storage at a time.

Each storage is allocated when a call that matters first writes it and handed over (``on_final``) as soon as no later
call touches it, then freed: a rank holds its own shards, plus the storages the construction has in flight (for
modules initialized as they are built, one layer's). A call whose result is overwritten before anything reads it
(``nn.Linear``'s own ``reset_parameters`` before a Hugging Face ``_init_weights``) is skipped, unless it draws from
the random generator: it then runs on a scratch tensor of the same shape, so that every later draw is the one one
device makes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_hybrid._torch_compat import tree_flatten, tree_map
from lightning_hybrid.construction.record import (
    REPLAY_DEVICE,
    ConstructionRecord,
    StorageView,
    generator_state,
    set_generator_state,
)

__all__ = ["ReplayReport", "replay"]

_EMPTY_FACTORIES = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


@dataclass
class ReplayReport:
    """What the replay found: storages that only an ``empty`` allocation ever wrote (uninitialized memory on one device
    too), and the most bytes it held at once."""

    uninitialized: set[int] = field(default_factory=set)
    peak_bytes: int = 0


def _needed(record: ConstructionRecord, wanted: set[int]) -> list[bool]:
    """Which calls the wanted storages' final values depend on (a backward pass over the log)."""
    live, needed = set(wanted), [False] * len(record.ops)
    for i in range(len(record.ops) - 1, -1, -1):
        op = record.ops[i]
        if op.real or not (op.writes & live):
            continue
        needed[i] = True
        live -= op.overwrites
        live |= op.reads
    return needed


class _Storages:
    """The real storages of the replay, allocated on first use."""

    def __init__(self, record: ConstructionRecord, device: torch.device) -> None:
        self.record, self.device = record, device
        self.real: dict[int, torch.UntypedStorage] = {}
        self.bytes = self.peak = 0

    def view(self, v: StorageView, scratch: dict[int, torch.UntypedStorage] | None = None) -> Tensor:
        pool = self.real if scratch is None else scratch
        storage = pool.get(v.storage)
        if storage is None:
            nbytes = self.record.nbytes[v.storage]
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            pool[v.storage] = storage
            self._count(storage.nbytes())
        return torch.empty(0, dtype=v.dtype, device=self.device).set_(storage, v.offset, v.size, v.stride)

    def adopt(self, v: StorageView, real: Tensor) -> None:
        """Take a call's new output as the storage behind ``v`` (copied only if its layout differs)."""
        if v.storage in self.real:
            return
        same = real.untyped_storage().nbytes() == self.record.nbytes[v.storage]
        if same and (tuple(real.stride()), real.storage_offset()) == (v.stride, v.offset):
            self.real[v.storage] = real.untyped_storage()
            self._count(self.real[v.storage].nbytes())
        else:
            self.view(v).copy_(real)

    def adopt_outputs(self, views: list[StorageView | None], outputs: list[Tensor]) -> None:
        for v, t in zip(views, outputs):  # (a loop in the caller's frame would keep its last tensor alive)
            if v is not None:
                self.adopt(v, t)

    def discard(self, scratch: dict[int, torch.UntypedStorage]) -> None:
        self.bytes -= sum(storage.nbytes() for storage in scratch.values())
        scratch.clear()

    def release(self, key: int) -> None:
        storage = self.real.pop(key, None)
        if storage is not None:
            self.bytes -= storage.nbytes()

    def _count(self, n: int) -> None:
        self.bytes += n
        self.peak = max(self.peak, self.bytes)


def replay(
    record: ConstructionRecord,
    device: torch.device,
    wanted: Mapping[int, Any],
    on_final: Callable[[int, Callable[[StorageView], Tensor]], None],
) -> ReplayReport:
    """Run ``record`` on ``device`` from the random state it started from; for each storage key in ``wanted``, call
    ``on_final(key, view)`` once its value is final (``view(storage_view)`` reads it; valid during the call only).

    The generator of the record's device is left where one device's construction would have left it when the
    construction ran after the strategy's seed reset and nothing drew from it since; otherwise as it was.

    Example:
        >>> from lightning_hybrid.construction.record import StorageView, record_construction, storage_key
        >>> _ = torch.manual_seed(0)
        >>> with record_construction() as record:
        ...     layer = torch.nn.Linear(3, 2)
        >>> values = {}
        >>> key = storage_key(layer.weight)
        >>> _ = replay(record, torch.device("cpu"), {key: None},
        ...            lambda k, view: values.setdefault(k, view(StorageView.of(layer.weight)).clone()))
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(values[key], torch.nn.Linear(3, 2).weight.detach())
        True
    """
    wanted_keys = set(wanted)
    needed = _needed(record, wanted_keys)
    last_touch: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        if needed[i]:
            for key in op.reads | op.writes:
                last_touch[key] = i
    report = ReplayReport()
    written_by_more_than_empty: set[int] = set()
    storages = _Storages(record, device)
    before = generator_state(record.device_type)
    assert record.rng_state is not None
    set_generator_state(record.device_type, record.rng_state)
    default_dtype = torch.get_default_dtype()
    recorded = record.rng_state  # the generator as the construction left it after its last draw so far
    try:
        for i, op in enumerate(record.ops):
            if not needed[i] and not op.seeded:
                continue
            if op.generator_before is not None:
                if not op.generator_before.equal(recorded):  # the construction reseeded here: so does the replay
                    set_generator_state(record.device_type, op.generator_before)
                recorded = op.generator_after if op.generator_after is not None else op.generator_before
            torch.set_default_dtype(op.default_dtype)
            if op.real:  # a random call on real tensors: draw again, on copies
                args, kwargs = tree_map(_clone_tensor, (op.args, op.kwargs))
                op.func(*args, **kwargs)
                continue
            scratch: dict[int, torch.UntypedStorage] | None = None if needed[i] else {}
            outs = _call(op, storages, device, scratch)
            if scratch is not None:
                # drawn for the generator's sake only: the scratch goes before the next call allocates (a rank that
                # holds neither the embedding nor the head draws both their first initializations, one after the
                # other: kept to the next call, two full tensors were in memory at once)
                storages.discard(scratch)
                continue
            storages.adopt_outputs(op.outputs, outs)
            del outs  # views of storages released below: held to the next call, each would outlive its release
            if _name(op.func) not in _EMPTY_FACTORIES:
                written_by_more_than_empty |= op.writes
            for key in op.reads | op.writes:
                if last_touch.get(key) != i:
                    continue
                if key in wanted_keys:
                    if key not in written_by_more_than_empty:
                        report.uninitialized.add(key)
                    on_final(key, storages.view)
                storages.release(key)
        report.peak_bytes = storages.peak
        after = generator_state(record.device_type)
        assert record.rng_state_at_end is not None
        if not record.rng_state_at_end.equal(recorded):  # reseeded after its last draw
            after = record.rng_state_at_end
    finally:
        torch.set_default_dtype(default_dtype)
    assert record.rng_state_at_end is not None
    nothing_drew_since = before.equal(record.rng_state_at_end)
    set_generator_state(record.device_type, after if record.after_seed_reset and nothing_drew_since else before)
    return report


def _call(
    op: Any, storages: _Storages, device: torch.device, scratch: dict[int, torch.UntypedStorage] | None
) -> list[Tensor]:
    """Run one recorded call on real storages (``scratch``: fresh ones, for a call whose result no wanted tensor
    needs); returns its tensor outputs (none for a scratch call). Its arguments die with this frame."""

    def real(x: Any) -> Any:
        if isinstance(x, StorageView):
            return storages.view(x, scratch)
        if x is REPLAY_DEVICE:
            return device
        return x

    with torch.no_grad():
        out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
    return [] if scratch is not None else [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]


def _name(func: Any) -> str:
    schema = getattr(func, "_schema", None)  # an ATen call; else a recorded torch.nn.init function
    return schema.name.split("::")[-1] if schema is not None else func.__name__


def _clone_tensor(x: Any) -> Any:
    return x.clone() if isinstance(x, Tensor) else x
