"""Small DTensor helpers shared by the sharding, checkpoint, monitoring and pipeline code: a tensor's local part,
its local bytes, a local tensor laid out like a DTensor parameter, and a DTensor as a plain tensor.

Each works on plain tensors too (as themselves), so callers need not branch on ``isinstance(t, DTensor)``.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_hybrid._torch_compat import dtensor_local_data

__all__ = ["like", "local_bytes", "local_tensor", "to_plain"]


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
