"""Each context-parallel rank's contiguous part of the batch's sequence dimension (every rank of a replica gets the
same samples: the sampler splits over replicas only)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.exchange import ContextShard

__all__ = ["sequence_length", "shard_batch", "whole_batch"]


def shard_batch(batch: Any, rank: int, size: int) -> Any:
    """``batch`` with every tensor of two or more dimensions cut along dimension 1 (the sequence, as
    ``[batch, seq, ...]``) into ``size`` equal parts, part ``rank`` kept; other values as they are. Every such tensor
    must have the same sequence length, divisible by ``size`` (refused otherwise, alike on every rank: every rank of
    a replica holds the same samples).

    Example:
        >>> shard_batch({"ids": torch.arange(8).view(1, 8), "n": torch.tensor([3])}, rank=1, size=2)["ids"]
        tensor([[4, 5, 6, 7]])
    """
    lengths = set()
    apply_to_collection(batch, torch.Tensor, lambda t: lengths.add(t.size(1)) if t.dim() >= 2 else None)
    if len(lengths) > 1 or any(n % size for n in lengths):
        raise HybridConfigError(
            f"`context_parallel_size={size}` cuts each batch tensor of shape [batch, sequence, ...] into {size} equal"
            f" parts along the sequence, but the batch's sequence lengths are {sorted(lengths)}. Give every tensor"
            f" of two or more dimensions one sequence length, a multiple of {size} (docs/context-parallel.md)."
        )
    if not lengths:
        return batch
    part = lengths.pop() // size
    return apply_to_collection(
        batch, torch.Tensor, lambda t: t[:, rank * part : (rank + 1) * part].contiguous() if t.dim() >= 2 else t
    )


def sequence_length(batch: Any) -> int:
    """The sequence length (dimension 1) of the batch's tensors of two or more dimensions; 0 when it has none."""
    lengths: list[int] = []
    apply_to_collection(batch, torch.Tensor, lambda t: lengths.append(t.size(1)) if t.dim() >= 2 else None)
    return lengths[0] if lengths else 0


def whole_batch(part: Any, shard: ContextShard) -> Any:
    """The inverse of :func:`shard_batch` (collective over the context ranks): every tensor of two or more dimensions
    gathered from the ranks' parts along dimension 1, in rank order; other values as they are (alike on every rank).
    """

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2:
            return t
        parts = [torch.empty_like(t) for _ in range(shard.size)]
        dist.all_gather(parts, t.contiguous(), group=shard.group)
        return torch.cat(parts, dim=1)

    return apply_to_collection(part, torch.Tensor, gather)
