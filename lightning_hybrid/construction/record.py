"""Record a model's construction on the meta device, as a program that can be replayed on a real device later.

A model built under :func:`record_construction` gets parameters and buffers on the meta device (no memory), while
every ATen operation of its construction is logged: the allocations, the random initializations
(``reset_parameters``, a Hugging Face model's ``_init_weights``), and what a constructor computes (rotary tables).
:func:`~lightning_hybrid.construction.replay.replay` later runs that log from the same random state on the real
device, one storage at a time, so each rank gets exactly the values one device would have built while it only keeps
its own shards (docs/big-models.md).

Why not torch's ``torch.device("meta")`` context alone: it leaves nothing to initialize from (``to_empty`` gives
uninitialized memory, and ``reset_parameters`` consumes the random stream in another order than the constructors
did), and Hugging Face models skip ``_init_weights`` when they see it. Why by hand: torch has no deferred-init
record/replay of its own (torchdistx's ``deferred_init`` did this in C++ and is not maintained for current torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_hybrid._torch_compat import (
    META_SKIPPING_INITIALIZERS,
    TorchDispatchMode,
    device_constructors,
    storage_identity,
    tree_flatten,
    tree_map,
)

__all__ = ["ConstructionRecord", "RecordedOp", "StorageView", "record_construction", "storage_key"]

# ops that replace every element of their first argument without reading it: the value before them is dead
OVERWRITING_OPS = frozenset(
    {"uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "geometric_",
     "log_normal_", "cauchy_"}
)  # fmt: skip
# torch.tensor / as_tensor hold data the constructor gives: real tensors (small), as on one device
_DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


def storage_key(t: Tensor) -> int:
    """The identity of ``t``'s storage, shared by all its views (the recording keeps every storage alive, so a key is
    never reused while it matters)."""
    return storage_identity(t)


@dataclass(frozen=True)
class StorageView:
    """A meta tensor as the replay sees it: which storage, read how (every view of one storage shares it)."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: Tensor) -> StorageView:
        return cls(storage_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def covers(self, nbytes: int) -> bool:
        """Whether this view is the whole of a storage of ``nbytes`` bytes, contiguous from its start."""
        contiguous = all(
            st == expected for st, expected, n in zip(self.stride, _contiguous_strides(self.size), self.size) if n > 1
        )
        numel = 1
        for n in self.size:
            numel *= n
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == nbytes


def _contiguous_strides(size: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return list(reversed(strides))


class _Device:
    """Stands for the device the replay runs on, where the construction said ``meta``."""

    def __repr__(self) -> str:
        return "<replay device>"


REPLAY_DEVICE = _Device()


@dataclass
class RecordedOp:
    """One ATen call of the construction, its tensors as :class:`StorageView` (meta) or as they are (real)."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: list[Optional[StorageView]]
    default_dtype: torch.dtype
    reads: frozenset[int]
    writes: frozenset[int]
    overwrites: frozenset[int]
    """Storages this call replaces whole (created, or overwritten without being read)."""
    seeded: bool
    """Whether the call draws from the random generator: it must run, in order, even when its result is not needed."""
    real: bool = False
    """A call on real tensors only (a ``torch.tensor`` constant...): it ran during the recording already."""
    generator_before: Optional[Tensor] = None
    """The generator's state before a drawing call: the replay sees from it where the construction reseeded
    (``seed_everything`` inside ``trainer.init_module()``), since meta calls draw nothing."""
    generator_after: Optional[Tensor] = None
    """After a real drawing call (which moved it)."""


@dataclass
class ConstructionRecord:
    """The log of one construction and the random state it started from."""

    ops: list[RecordedOp] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)
    """Bytes of each storage the construction made on the meta device."""
    device_type: str = "cpu"
    """The generator the construction would have drawn from on one device (its device's)."""
    rng_state: Optional[Tensor] = None
    rng_state_at_end: Optional[Tensor] = None
    """The generator when the recording ended (the meta calls draw nothing; real random calls do)."""
    keep_alive: list[Tensor] = field(default_factory=list)
    """The meta tensors seen, so that no storage key is reused while the record exists."""
    after_seed_reset: bool = False
    """Recorded after the strategy reset the seed (``configure_model``): one device's construction would have left
    the generator where the replay leaves it. Before it (``trainer.init_module()``), the reset discarded that."""

    def knows(self, t: Tensor) -> bool:
        return storage_key(t) in self.nbytes


def generator_state(device_type: str) -> Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_generator_state(device_type: str, state: Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class _MetaFactories(TorchFunctionMode):
    """Factory functions without a device make meta tensors. Unlike ``torch.device("meta")`` this leaves torch's
    default device as it is, so a model (Hugging Face's ``init_weights``) sees no meta context and initializes as on
    one device; the initialization is recorded instead of computed."""

    def __init__(self) -> None:
        super().__init__()
        self._constructors = device_constructors() - _DATA_CONSTRUCTORS

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in self._constructors and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def _recorded_initializers(recorder: _Recorder) -> Iterator[None]:
    """``torch.nn.init``'s initializers that skip meta tensors (their sampling reads values) are recorded as one call
    each, which the replay makes on the real tensor, in order: the same draws as on one device."""
    originals = {name: getattr(torch.nn.init, name) for name in META_SKIPPING_INITIALIZERS}

    def recording(original: Any) -> Any:
        def initializer(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(tensor, Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            recorder.record_initializer(original, (tensor, *args), kwargs)
            # the call is the unit the replay makes: the ATen calls it runs on meta (torch versions whose sampling
            # does not read values run it there) are not recorded a second time
            with recorder.suspended():
                return original(tensor, *args, **kwargs)

        return initializer

    for name, original in originals.items():
        setattr(torch.nn.init, name, recording(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.nn.init, name, original)


class _Recorder(TorchDispatchMode):
    def __init__(self, record: ConstructionRecord) -> None:
        super().__init__()
        self.record = record
        self._suspended = False
        self._last_state: Optional[Tensor] = None

    def _generator(self) -> Tensor:
        """The generator's state now: the object recorded last while it has not moved. Random calls on meta draw
        nothing, so a construction of N of them would otherwise keep N equal copies (5 KB each on CPU: 1.7 MB of a
        0.47B Llama's record, held until the replay ends)."""
        state = generator_state(self.record.device_type)
        if self._last_state is not None and state.equal(self._last_state):
            return self._last_state
        self._last_state = state
        return state

    @contextmanager
    def suspended(self) -> Iterator[None]:
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def record_initializer(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An in-place initializer of ``args[0]``: it writes the whole tensor without reading it, and may draw."""
        generator = self._generator()
        target = self._view(args[0])
        whole = target.covers(self.record.nbytes[target.storage])
        others = {storage_key(t) for t in tree_flatten((args[1:], kwargs))[0] if isinstance(t, Tensor) and t.is_meta}
        self.record.ops.append(
            RecordedOp(
                func,
                tree_map(self._as_recorded, args),
                tree_map(self._as_recorded, kwargs),
                [],
                torch.get_default_dtype(),
                frozenset(others if whole else others | {target.storage}),
                frozenset({target.storage}),
                frozenset({target.storage} if whole else ()),
                seeded=True,
                generator_before=generator,
            )
        )

    def _view(self, t: Tensor) -> StorageView:
        key = storage_key(t)
        if key not in self.record.nbytes:
            self.record.nbytes[key] = t.untyped_storage().nbytes()
            self.record.keep_alive.append(t)
        return StorageView.of(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        generator = self._generator() if seeded else None
        out = func(*args, **kwargs)
        schema = func._schema
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if not any(t.is_meta for t in (*inputs, *outputs)):
            if seeded:  # a real random call still moves the generator: the replay must move it alike
                self.record.ops.append(
                    RecordedOp(func, args, kwargs, [], torch.get_default_dtype(), frozenset(), frozenset(),
                               frozenset(), seeded=True, real=True, generator_before=generator,
                               generator_after=self._generator())
                )  # fmt: skip
            return out
        written_args = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        returns_alias = all(r.alias_info is not None for r in schema.returns) and schema.returns
        if returns_alias and not written_args:
            return out  # a view: the replay reads every tensor through its storage, views need no replay
        bound = dict(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        written = [bound[n] for n in written_args if isinstance(bound.get(n), Tensor)]
        input_keys = {storage_key(t) for t in inputs if t.is_meta}
        created = {storage_key(t) for t in outputs if t.is_meta} - input_keys
        writes = {storage_key(t) for t in written if t.is_meta} | created
        overwrites = set(created)
        name = schema.name.split("::")[-1]
        if name in OVERWRITING_OPS and written and written[0] is args[0] and args[0].is_meta:
            first = self._view(args[0])
            if first.covers(self.record.nbytes[first.storage]):
                overwrites.add(first.storage)  # its value before this call is not read
        reads = input_keys - overwrites
        self.record.ops.append(
            RecordedOp(
                func,
                tree_map(self._as_recorded, args),
                tree_map(self._as_recorded, kwargs),
                [self._view(t) if t.is_meta else None for t in outputs],
                torch.get_default_dtype(),
                frozenset(reads),
                frozenset(writes),
                frozenset(overwrites),
                seeded=seeded,
                generator_before=generator,
            )
        )
        return out

    def _as_recorded(self, x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_meta:
            return self._view(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return REPLAY_DEVICE
        return x  # real tensors (constants), numbers, dtypes, generators


@contextmanager
def record_construction(device_type: str = "cpu", *, after_seed_reset: bool = False) -> Iterator[ConstructionRecord]:
    """Build modules on the meta device and record how; replay later with
    :func:`~lightning_hybrid.construction.replay.replay`.

    Example:
        >>> with record_construction() as record:
        ...     layer = torch.nn.Linear(4, 2)
        >>> layer.weight.is_meta, len(record.ops) > 0
        (True, True)
    """
    record = ConstructionRecord(device_type=device_type, rng_state=generator_state(device_type))
    record.after_seed_reset = after_seed_reset
    recorder = _Recorder(record)
    with _MetaFactories(), recorder, _recorded_initializers(recorder):
        yield record
    record.rng_state_at_end = generator_state(device_type)
