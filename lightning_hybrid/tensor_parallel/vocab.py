"""Logits split over the vocabulary, as the user's code sees them: a tensor that behaves as the whole logits.

Under tensor parallel the vocabulary head computes each rank's share of the vocabulary (a column-wise split). The
common loss, a cross-entropy, needs from each share only a few numbers per row (Megatron-LM's vocabulary-parallel
cross-entropy, ``vocab_loss.py``), so a model never needs its ``B x T x V`` logits whole on any rank for it. Any other
use of the logits does need them whole. The head's output therefore reaches the code that reads it (the step, or the
network's own forward, where Hugging Face models compute their loss) as a :class:`VocabParallelLogits`: a tensor with
the whole logits' shape, dtype and device, whose values stay split until an operation needs them whole.

What runs on the shares, recognised from the function called and its arguments (``__torch_function__``), exact by
construction:

- ``F.cross_entropy`` with class-index targets, ``ignore_index``, any ``reduction`` and ``label_smoothing`` (without a
  class ``weight``) whose class dimension is the vocabulary, and ``F.nll_loss`` of a ``log_softmax`` over the
  vocabulary in the same way (:func:`~lightning_hybrid.tensor_parallel.vocab_loss.vocab_parallel_cross_entropy`);
- ``log_softmax`` over the vocabulary: kept split and marked as log-probabilities; made whole only if something other
  than ``nll_loss`` reads it;
- what moves no value across the vocabulary: ``view``/``reshape``/``flatten`` that keep the vocabulary as the last
  dimension, indexing the other dimensions (``logits[:, :-1]``, ``logits[mask]``), ``transpose``/``permute``/
  ``movedim``, ``contiguous``, ``detach``, ``clone`` and casts (``float()``, ``to(dtype)``).

Everything else (an argmax, a KL divergence, a gather of token log-probabilities, an MSE, ``.tolist()``) gets the
whole logits: one all-gather over the tensor-parallel ranks, differentiable (its backward keeps each rank's share of
the gradient, which every rank computed alike), made once per tensor while it lives; the operation then runs on a plain
tensor, as on one device. A tensor written in place (``logits[..., pad] = -inf``) becomes whole first.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lightning_hybrid._torch_compat import (
    make_wrapper_tensor,
    op_name,
    storage_identity,
    torch_function_disabled,
    tree_flatten,
    tree_map,
    written_arguments,
)
from lightning_hybrid.tensor_parallel.vocab_loss import vocab_parallel_cross_entropy

__all__ = ["VocabParallelLogits", "split_logits_hook", "whole_logits"]


def _getters(*names: str) -> set[Any]:
    return {getattr(Tensor, n).__get__ for n in names if hasattr(Tensor, n)}


# read off the wrapper itself (it carries the whole logits' shape, dtype and device): no values needed
_METADATA = _getters(
    "shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "is_xpu", "is_mps", "itemsize", "nbytes", "names",
) | {Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.__len__, Tensor.is_floating_point,
     Tensor.is_complex, Tensor.element_size, Tensor.get_device, Tensor.ndimension, Tensor.is_signed}  # fmt: skip
_AUTOGRAD = _getters("requires_grad", "grad_fn", "is_leaf", "grad")
_IN_PLACE_OPERATORS = {
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
}  # fmt: skip
# what only a whole tensor can honour: a hook or retained gradient on the logits themselves
_WHOLE_FIRST = {Tensor.register_hook, Tensor.retain_grad, Tensor.requires_grad_}
if hasattr(Tensor, "register_post_accumulate_grad_hook"):
    _WHOLE_FIRST.add(Tensor.register_post_accumulate_grad_hook)

_READ_FIRST = {"send", "isend", "gather"}  # torch.distributed functions that read their first tensor
_RESHAPES = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten}
_MOVES = {Tensor.transpose, torch.transpose, Tensor.permute, torch.permute, Tensor.movedim, torch.movedim}
_ELEMENTWISE = {Tensor.contiguous, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to,
                Tensor.detach, torch.detach, Tensor.clone, torch.clone}  # fmt: skip
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, Tensor.log_softmax}
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_NLL_LOSS = inspect.signature(F.nll_loss)


class _Shards:
    """What a family of split tensors shares: the tensor-parallel mesh, this rank's place in it, the vocabulary."""

    def __init__(self, mesh: Any, vocab: int) -> None:
        self.mesh, self.vocab = mesh, vocab
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def gather(self, local: Tensor, dim: int) -> Tensor:
        """The whole tensor from every rank's ``local`` share of dimension ``dim`` (differentiable)."""
        VocabParallelLogits.gathers += 1
        if self.size == 1:
            return local
        return DTensor.from_local(local, self.mesh, [Shard(dim)], run_check=False).full_tensor()


class VocabParallelLogits(Tensor):
    """The vocabulary head's output under tensor parallel: behaves as the whole logits (shape, dtype, device, every
    operation's result), holds this rank's share of the vocabulary. See the module's docstring for what runs on the
    shares; every other operation runs on the whole logits, gathered once.

    Example:
        >>> # logits = network(x)                                   # a VocabParallelLogits, [B, T, V]
        >>> # loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))   # on the shares
        >>> # accuracy = (logits.argmax(-1) == y).float().mean()    # gathered once, then plain
    """

    gathers = 0
    """How many times split logits were gathered whole in this process (for tests and measurements)."""

    _local: Tensor
    _shards: _Shards
    _vocab_dim: int
    _log_probs: bool
    _parent: Optional[VocabParallelLogits]
    _replay: Optional[Callable[[Tensor], Tensor]]
    _full: Optional[Tensor]
    _full_detached: Optional[Tensor]
    _whole: Optional[Tensor]
    _aliases_parent: bool
    _aliasing_children: list[weakref.ref]

    @staticmethod
    def __new__(
        cls,
        local: Tensor,
        shards: _Shards,
        vocab_dim: int,
        *,
        log_probs: bool = False,
        parent: Optional[VocabParallelLogits] = None,
        replay: Optional[Callable[[Tensor], Tensor]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> VocabParallelLogits:
        shape = list(local.shape)
        shape[vocab_dim] = shards.vocab
        self = make_wrapper_tensor(cls, tuple(shape), dtype or local.dtype, local.device)
        self._local, self._shards, self._vocab_dim, self._log_probs = local, shards, vocab_dim, log_probs
        self._parent, self._replay = parent, replay
        self._full = self._full_detached = self._whole = None
        self._aliases_parent = parent is not None and _same_storage(local, parent._local)
        self._aliasing_children = []
        if self._aliases_parent:
            parent._aliasing_children.append(weakref.ref(self))
        return self

    @classmethod
    def of(cls, output: DTensor) -> VocabParallelLogits:
        """The head's output (a DTensor sharded over its last dimension, the vocabulary) as split logits."""
        (placement,) = output.placements
        assert isinstance(placement, Shard), placement
        vocab_dim = placement.dim % output.ndim
        return cls(output.to_local(), _Shards(output.device_mesh, output.shape[vocab_dim]), vocab_dim)

    def full_tensor(self) -> Tensor:
        """The whole logits as a plain tensor (gathered once, differentiable; collective over the tensor ranks)."""
        return self._materialize()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        # no values: printing them would gather over the tensor ranks, and a repr may run on one rank only (a
        # debugger, an error report), where the gather would wait for the others forever
        kind = "log-probabilities" if self._log_probs else "logits"
        return (
            f"VocabParallelLogits({kind}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device},"
            f" vocabulary dimension {self._vocab_dim} split over {self._shards.size} tensor-parallel ranks;"
            " .full_tensor() gathers the values)"
        )

    def __format__(self, spec: str) -> str:
        return repr(self) if not spec else format(self.full_tensor(), spec)

    # ---------------------------------------------------------------------------------------------- whole values
    def _cached(self) -> Optional[Tensor]:
        """The whole tensor made before, where it serves here (one made without autograd history, under
        ``no_grad``, does not serve where a gradient is needed)."""
        if self._whole is not None:
            return self._whole
        if self._full is not None:
            return self._full
        tracked = torch.is_grad_enabled() and self._local.requires_grad
        return self._full_detached if not tracked else None

    def _materialize(self) -> Tensor:
        """The whole tensor, kept while ``self`` lives. A derived tensor replays its operation on its parent's whole
        tensor (so a family gathers once), but one smaller than its parent gathers its own shares unless the parent
        has its whole tensor already: an index of the last position gathers that position only (the operations
        derived on the shares commute with the gather). Log-probabilities replay their ``log_softmax``."""
        full = self._cached()
        if full is not None:
            return full
        parent = self._parent
        if (
            parent is not None
            and self._replay is not None
            and (self._log_probs or parent._cached() is not None or self._local.numel() >= parent._local.numel())
        ):
            full = self._replay(parent._materialize())
        else:
            full = self._shards.gather(self._local, self._vocab_dim)
        if full.requires_grad:
            self._full = full
        else:
            self._full_detached = full
        return full

    def _become_whole(self, why: str) -> Tensor:
        """From now on ``self`` is its whole tensor (an in-place write, a hook on the logits): refused where another
        split tensor shares its values (a view taken before, or the tensor it is a view of), which would not see it."""
        if self._whole is None:
            children = [c for ref in self._aliasing_children if (c := ref()) is not None]
            if self._aliases_parent or children:
                raise RuntimeError(
                    f"{why} on logits split over the vocabulary (tensor parallel's `vocab_parallel_loss=True`) that"
                    " share their values with another view of them: the split tensors cannot show the change in each"
                    " other. Write to a copy (`logits = logits.clone()` first), or pass `vocab_parallel_loss=False`."
                )
            # a copy: the gather's output is a view made inside an autograd function, which autograd does not let
            # be written in place; the gathered tensor is dropped, so the copy takes its place rather than doubling
            self._whole = self._materialize().clone()
            self._full = self._full_detached = None
        return self._whole

    # ---------------------------------------------------------------------------------------------- dispatch
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch_function_disabled():
                return func(*args, **kwargs)
        if func is Tensor.__hash__:
            return id(args[0])
        if func in _AUTOGRAD:
            self = args[0]
            source = self._whole if self._whole is not None else self._local
            if func == Tensor.grad.__get__:
                return source.grad if self._whole is not None else None
            return func(source)
        if func in (F.cross_entropy, F.nll_loss):
            loss = _split_loss(func, args, kwargs)
            if loss is not None:
                return loss
        self = args[0] if args and isinstance(args[0], VocabParallelLogits) else None
        target = _written(func, args, kwargs)
        if target is not None:
            whole = target._become_whole(f"`{getattr(func, '__name__', func)}`")
            args, kwargs = tree_map(lambda a: whole if a is target else _whole_of(a), (args, kwargs))
            out = func(*args, **kwargs)
            return target if out is whole else out
        if self is not None and self._whole is None and not _holds_split(args[1:], kwargs):
            derived = _derive(self, func, args, kwargs)
            if derived is not None:
                return derived
        args, kwargs = tree_map(_whole_of, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        # reached only by a call that bypassed __torch_function__ (c10d's collectives, C++ code): read-only uses get
        # the whole values; a write would land on a copy, so it is refused
        kwargs = kwargs or {}
        written = written_arguments(func)
        if func.namespace == "c10d" and op_name(func).endswith("_"):
            written.append((0, ""))  # c10d's in-place collectives write their first argument (unannotated)
        for position, name in written:
            value = args[position] if position < len(args) else kwargs.get(name)
            if _holds_split((value,), {}):
                raise RuntimeError(
                    f"`{func}` writes into logits split over the vocabulary (tensor parallel's"
                    " `vocab_parallel_loss=True`), which hold no whole values to write to. Pass"
                    " `logits.full_tensor()` (a plain tensor), or `vocab_parallel_loss=False`."
                )
        with torch.no_grad():
            args, kwargs = tree_map(_whole_of, (args, kwargs))
        return func(*args, **kwargs)


def split_logits_hook(module: Any, args: Any, output: Any) -> Any:
    """A forward hook for the vocabulary head: its DTensor output (sharded over the vocabulary) as
    :class:`VocabParallelLogits`, so that no DTensor reaches the code that reads the logits.

    Example:
        >>> # head.register_forward_hook(split_logits_hook)   # after ColwiseParallel(output_layouts=Shard(-1), ...)
    """
    return VocabParallelLogits.of(output) if isinstance(output, DTensor) else output


def whole_logits(value: Any) -> Any:
    """``value`` (a tensor or a collection of them: mappings, sequences, dataclasses such as a Hugging Face model's
    output) with every split-logits tensor made a plain, whole tensor (collective over the tensor-parallel ranks
    where there is one).

    Example:
        >>> whole_logits({"loss": torch.ones(1)})["loss"]
        tensor([1.])
    """
    return apply_to_collection(value, VocabParallelLogits, _whole_of)


def _whole_of(value: Any) -> Any:
    return value._materialize() if isinstance(value, VocabParallelLogits) else value


def _holds_split(args: Any, kwargs: dict) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(leaf, VocabParallelLogits) for leaf in leaves)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return storage_identity(a) == storage_identity(b)


def _written(func: Any, args: tuple, kwargs: dict) -> Optional[VocabParallelLogits]:
    """The split tensor ``func`` writes into or hooks (an in-place method, ``out=``, ``inplace=True``), if any."""
    out = kwargs.get("out")
    if isinstance(out, VocabParallelLogits):
        return out
    first = args[0] if args else kwargs.get("input")
    if not isinstance(first, VocabParallelLogits):
        return None
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
    # torch.distributed's collectives write their first tensor (all_reduce, broadcast, recv, ...), but for these
    in_place |= getattr(func, "__module__", "").startswith("torch.distributed") and name not in _READ_FIRST
    return first if in_place or kwargs.get("inplace") is True or func in _WHOLE_FIRST else None


# ---------------------------------------------------------------------------------------------- on the shares
def _derive(self: VocabParallelLogits, func: Any, args: tuple, kwargs: dict) -> Optional[VocabParallelLogits]:
    """``func(self, ...)`` as a split tensor, where ``func`` moves no value across the vocabulary; None otherwise."""
    rest = args[1:]

    def child(local: Tensor, vocab_dim: int, **extra: Any) -> VocabParallelLogits:
        replay = extra.pop("replay", None) or (lambda full: func(full, *rest, **kwargs))
        return VocabParallelLogits(local, self._shards, vocab_dim, log_probs=self._log_probs, parent=self,
                                   replay=replay, **extra)  # fmt: skip

    local, last = self._local, self.dim() - 1
    if func in _ELEMENTWISE:
        out = func(local, *rest, **kwargs)
        if isinstance(out, Tensor) and out.shape == local.shape and out.device == local.device:
            return child(out, self._vocab_dim)
        return None
    if func in _RESHAPES:
        if self._vocab_dim != last or any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
            return None  # view(dtype) reinterprets the bytes
        shape = func(torch.empty(self.shape, device="meta"), *rest, **kwargs).shape
        if not shape or shape[-1] != self._shards.vocab:
            return None  # the vocabulary no longer a dimension of its own
        try:
            out = (local.view if func is Tensor.view else local.reshape)((*shape[:-1], local.shape[-1]))
        except RuntimeError:
            return None  # a view the shard's strides do not allow: made on the whole tensor instead
        return child(out, len(shape) - 1)
    if func in _MOVES:
        # where the vocabulary dimension goes: follow a stride that only it has
        strides = [2**i for i in range(self.dim())]
        probe = func(torch.empty_strided(self.shape, strides, device="meta"), *rest, **kwargs)
        return child(func(local, *rest, **kwargs), probe.stride().index(strides[self._vocab_dim]))
    if func is Tensor.__getitem__:
        if self._vocab_dim != last or not _leaves_last_dimension(args[1], self.dim()):
            return None
        out = local[args[1]]
        return child(out, out.dim() - 1) if out.dim() and out.shape[-1] == local.shape[-1] else None
    if func in _LOG_SOFTMAX and not self._log_probs:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dtype = kwargs.get("dtype", args[3] if func is F.log_softmax and len(args) > 3 else None)
        if func is not F.log_softmax and len(args) > 2:
            dtype = args[2]
        if not isinstance(dim, int) or dim % self.dim() != self._vocab_dim:
            return None
        split = local if dtype is None else local.to(dtype)
        # the dtype the operation gives here (autocast may change it), from the operation on an empty tensor
        result_dtype = torch.log_softmax(torch.empty(0, dtype=split.dtype, device=split.device), 0).dtype
        out = VocabParallelLogits(split, self._shards, self._vocab_dim, log_probs=True, parent=self,
                                  replay=lambda full: func(full, *rest, **kwargs), dtype=result_dtype)  # fmt: skip
        return out
    return None


def _leaves_last_dimension(index: Any, ndim: int) -> bool:
    """Whether ``tensor[index]`` keeps the last dimension whole and last (indexes, slices, masks of the others)."""
    entries = index if isinstance(index, tuple) else (index,)
    if any(isinstance(e, VocabParallelLogits) or isinstance(e, bool) for e in entries):
        return False

    def consumed(e: Any) -> int:
        if e is None or e is Ellipsis:
            return 0
        if isinstance(e, Tensor) and e.dtype == torch.bool:
            return max(e.dim(), 1)
        return 1

    full = slice(None)
    if Ellipsis in [e for e in entries if not isinstance(e, Tensor)]:
        after = entries[[i for i, e in enumerate(entries) if e is Ellipsis][0] + 1 :]
        return not after or (isinstance(after[-1], slice) and after[-1] == full)
    used = sum(consumed(e) for e in entries)
    if used < ndim:
        return True  # the dimensions not indexed, the last among them, follow every indexed one
    return used == ndim and isinstance(entries[-1], slice) and entries[-1] == full


def _split_loss(func: Any, args: tuple, kwargs: dict) -> Optional[Tensor]:
    """``F.cross_entropy`` of split logits, or ``F.nll_loss`` of their split ``log_softmax``, over the vocabulary
    and with class-index targets: computed on the shares. None where the call is anything else."""
    try:
        bound = (_CROSS_ENTROPY if func is F.cross_entropy else _NLL_LOSS).bind(*args, **kwargs)
    except TypeError:
        return None
    given = bound.arguments
    logits, target = given.get("input"), given.get("target")
    if not isinstance(logits, VocabParallelLogits) or logits._whole is not None:
        return None
    if func is F.nll_loss and not logits._log_probs:
        return None  # nll_loss of raw logits: not a cross-entropy
    class_dim = 1 if logits.dim() >= 2 else 0
    reduction = given.get("reduction", "mean")
    smoothing = float(given.get("label_smoothing", 0.0))
    plain_call = all(given.get(k) is None for k in ("weight", "size_average", "reduce"))
    if (
        not plain_call
        or reduction not in ("mean", "sum", "none")
        or not 0.0 <= smoothing <= 1.0
        or logits._vocab_dim != class_dim
        or not logits.is_floating_point()
        or not isinstance(target, Tensor)
        or isinstance(target, VocabParallelLogits)
        or target.is_floating_point()  # class probabilities as targets: on the whole logits
        or tuple(target.shape) != tuple(s for i, s in enumerate(logits.shape) if i != class_dim)
    ):
        return None
    shards = logits._shards
    start = shards.rank * logits._local.shape[class_dim]
    loss = vocab_parallel_cross_entropy(
        logits._local, target, shards.group, start, shards.vocab, ignore_index=int(given.get("ignore_index", -100)),
        reduction=reduction, label_smoothing=smoothing,
    )  # fmt: skip
    # the dtype the call gives on one device (float32 under autocast, else the logits'), from the call on empty input
    empty = torch.empty((0, 1), dtype=logits.dtype, device=logits.device)
    return loss.to(func(empty, torch.empty(0, dtype=torch.long, device=logits.device)).dtype)
