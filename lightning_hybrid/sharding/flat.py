"""The flat form ZeRO-0/1/2 keeps gradients and optimizer shards in, and the data-parallel collectives over it.

A :class:`FlatGroup` is one optimizer parameter group laid end to end: its parameters' local tensors, one after
another, as one flat buffer that the data-parallel ranks hold in equal shards (rank ``d`` owns elements
``[d * shard_size, (d + 1) * shard_size)``), as in DeepSpeed and Megatron's distributed optimizer. The collectives
here are the few every reduction of those buffers uses: reduce-scatter and all-gather of a flat tensor (one name for
both torch spellings), and a mean all-reduce that works on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.dtensor import local_grad, local_tensor

__all__ = [
    "DataDomain",
    "FlatGroup",
    "all_gather_flat",
    "all_reduce_mean",
    "flat_grads",
    "reduce_scatter_flat",
    "unflatten_into",
]


def reduce_scatter_flat(output: Tensor, input: Tensor, group: Any) -> None:
    # torch 2.13 renamed the flat collectives; 2.11/2.12 only have the old names (looked up per call, so tools that
    # wrap torch.distributed, like the tests' collective counter, see them)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)


def all_gather_flat(output: Tensor, input: Tensor, group: Any) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def all_reduce_mean(flat: Tensor, group: Any, size: int) -> None:
    # ReduceOp.AVG is nccl-only; SUM then divide works on every backend
    dist.all_reduce(flat, group=group)
    flat.div_(size)


def flat_grads(params: list[nn.Parameter], pad_to: int = 0) -> Tensor:
    """The parameters' local gradients laid end to end (zeros for a parameter without one), padded to ``pad_to``."""
    pieces = [
        g.reshape(-1) if (g := local_grad(p)) is not None else local_tensor(p).new_zeros(local_tensor(p).numel())
        for p in params
    ]
    flat = torch.cat(pieces) if pieces else torch.zeros(0)
    if pad_to > flat.numel():
        flat = torch.cat([flat, flat.new_zeros(pad_to - flat.numel())])
    return flat


def unflatten_into(targets: list[Tensor], flat: Tensor) -> None:
    """Copy consecutive pieces of ``flat`` into ``targets``, in order (the inverse of laying them end to end)."""
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


@dataclass(frozen=True)
class DataDomain:
    """The data-parallel ranks a flat group is averaged and sharded over: all of them for dense weights; under expert
    parallel, for expert weights, the ``dp / ep`` ranks holding the same experts.

    Example:
        >>> DataDomain(group=None, size=2, rank=0).sharded_size(10)
        5
    """

    group: Any
    size: int
    rank: int

    def sharded_size(self, numel: int) -> int:
        return -(-numel // self.size)


@dataclass
class FlatGroup:
    """One optimizer parameter group as a flat buffer: its parameters, their local elements in all, the shard this
    rank steps, its master copy and its fp32 gradient buffer (see
    :class:`~lightning_hybrid.sharding.ShardedOptimizer`)."""

    params: list[nn.Parameter]
    numel: int
    shard_size: int  # elements of the flat group this rank steps (all of them when not sharded)
    master: Optional[nn.Parameter]  # the master copy of those elements (stage 1/2, or low-precision parameters)
    grad_buffer: Optional[Tensor] = None  # fp32 gradient accumulation (low-precision parameters)
    domain: Optional[DataDomain] = None  # the ranks it is reduced and sharded over (set by ShardedOptimizer)

    @property
    def ranks(self) -> DataDomain:
        assert self.domain is not None
        return self.domain
