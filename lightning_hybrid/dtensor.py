"""Small DTensor helpers shared by the sharding, checkpoint, monitoring and pipeline code: a tensor's local part,
its local bytes, a local tensor laid out like a DTensor parameter, a DTensor as a plain tensor or whole on every rank
(fused projections included), and a parameter's local gradient.

Each works on plain tensors too (as themselves), so callers need not branch on ``isinstance(t, DTensor)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_hybrid._torch_compat import dtensor_local_data, is_strided_shard

__all__ = [
    "autograd_local_grad",
    "full_tensor",
    "is_fused",
    "like",
    "local_bytes",
    "local_grad",
    "local_parameters",
    "local_tensor",
    "to_plain",
    "unstrided",
]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's storage of a (possibly DTensor) tensor; writes to it write the tensor.

    Example:
        >>> import torch
        >>> local_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard), read without an autograd call.

    Example:
        >>> import torch
        >>> local_bytes(torch.zeros(3, dtype=torch.float16))
        6
    """
    t = dtensor_local_data(t)
    return t.numel() * t.element_size()


def like(local: Tensor, p: Tensor) -> Tensor:
    """``local`` (shaped like ``p``'s local tensor) as a tensor laid out like ``p``: for a DTensor ``p``, a DTensor of
    its mesh, placements, global shape and stride whose local tensor is ``local`` (no copy, no check); else ``local``.

    Example:
        >>> import torch
        >>> like(torch.zeros(2), torch.ones(2)).tolist()
        [0.0, 0.0]
    """
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def to_plain(t: DTensor) -> Tensor:
    """A DTensor as a plain tensor: a replicated one's local value is the full value; others are gathered."""
    if all(p.is_replicate() for p in t.placements):
        return t.to_local()
    return t.full_tensor()


def local_grad(p: nn.Parameter) -> Optional[Tensor]:
    """This rank's gradient storage for ``p``, laid out like ``p``'s own local tensor.

    With ``-true`` precisions this is the parameter's fp32 ``main_grad`` view (see
    :class:`~lightning_hybrid.sharding.ShardedOptimizer`). DTensor autograd may leave a gradient in another
    placement than its parameter (a vocab-parallel embedding's gradient comes back Replicate); redistributing it to
    the parameter's placement first keeps flat offsets aligned.
    """
    main = getattr(p, "main_grad", None)
    if main is not None:
        return main  # low-precision parameters accumulate into an fp32 buffer (ShardedOptimizer with masters)
    return autograd_local_grad(p)


def autograd_local_grad(p: nn.Parameter) -> Optional[Tensor]:
    """This rank's part of ``p.grad`` as autograd left it (ignoring ``main_grad``), in ``p``'s placement."""
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


def _fused_index(t: DTensor) -> Optional[int]:
    """The mesh dimension whose placement splits a fused projection (``_StridedShard`` with no later mesh dimension
    sharding the same tensor dimension). FSDP2's own ``_StridedShard`` over data, under a tensor-parallel ``Shard`` of
    the same dimension, is an ordinary contiguous chunk that DCP handles itself."""
    for i, p in enumerate(t.placements):
        if is_strided_shard(p) and not any(q.is_shard(p.dim) for q in t.placements[i + 1 :]):
            return i
    return None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def unstrided(t: DTensor) -> DTensor:
    """A fused projection's DTensor (``_StridedShard(d, k)`` over tensor ranks, which DCP cannot lay out) as the
    same storage viewed with dimension ``d`` split into ``[k, size/k]`` and a plain ``Shard(d + 1)``: each rank's part
    is one contiguous slab per block in that view, so DCP saves, loads and reshards it like any sharded tensor."""
    index = _fused_index(t)
    assert index is not None
    d, k = t.placements[index].dim % t.dim(), t.placements[index].split_factor
    local = t.to_local()
    placements = []
    for i, p in enumerate(t.placements):
        if i == index:
            placements.append(Shard(d + 1))
        elif p.is_shard() and p.dim % t.dim() >= d:
            placements.append(Shard(p.dim % t.dim() + 1))  # a later dimension shifts by the added block dimension
        else:
            placements.append(p)
    shape = (*t.shape[:d], k, t.shape[d] // k, *t.shape[d + 1 :])
    view = local.view(*local.shape[:d], k, local.shape[d] // k, *local.shape[d + 1 :])
    return DTensor.from_local(view, t.device_mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape))


def is_fused(t: Any) -> bool:
    """Whether ``t`` is a fused projection's DTensor, which DCP sees through a ``[k, rows/k, ...]`` view."""
    return isinstance(t, DTensor) and _fused_index(t) is not None


def full_tensor(t: Tensor) -> Tensor:
    """``t`` whole, on every rank: ``DTensor.full_tensor()`` (a collective), also for a fused projection, which is
    gathered through its block view (a plain ``Shard``): torch 2.11 cannot redistribute a strided shard. A plain
    tensor is returned as it is.

    Example:
        >>> import torch
        >>> full_tensor(torch.ones(2))
        tensor([1., 1.])
    """
    if not isinstance(t, DTensor):
        return t
    if is_fused(t):
        return unstrided(t).full_tensor().reshape(t.shape)
    return t.full_tensor()


@contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """Run ``module``'s own forward with each DTensor parameter replaced by its local shard.

    torch has no public "forward with these tensors in place of the parameters" that does not re-enter the module's
    ``__call__`` (``torch.func.functional_call`` would run its hooks twice), so the direct parameters are swapped by
    attribute, every one of them, and put back in their order: parameter order is what optimizers and checkpoints see.
    """
    params = list(module.named_parameters(recurse=False))
    for name, _ in params:
        delattr(module, name)
    try:
        for name, param in params:
            # a view: the local tensor of a DTensor parameter carries the flag that makes it pass for a Parameter
            setattr(module, name, param.to_local().view_as(param.to_local()) if isinstance(param, DTensor) else param)
        yield
    finally:
        for name, _ in params:
            if hasattr(module, name):
                delattr(module, name)
        for name, param in params:
            module.register_parameter(name, param)
