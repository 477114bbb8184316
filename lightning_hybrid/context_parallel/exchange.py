"""The all-to-all of context parallel (DeepSpeed-Ulysses): each context-parallel rank holds ``seq / cp`` tokens of
every head; before attention, q, k and v are exchanged so that each rank holds the whole sequence of ``heads / cp``
heads, attention runs with the ordinary mask over the whole sequence, and its output is exchanged back.

Written here rather than taken from torch: ``torch.distributed.tensor.experimental.context_parallel`` shards SDPA's
own kernels, and the CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) has no sharding rule (torch
2.11-2.13: NotImplementedError), while the head exchange composes with any attention kernel and any mask. The
exchange itself is torch's differentiable ``all_to_all`` (its backward is the inverse all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all

__all__ = ["ContextShard", "heads_to_sequence", "sequence_to_heads"]


@dataclass(frozen=True)
class ContextShard:
    """This rank's place among the context-parallel ranks of its replica: the group of the all-to-alls, the rank in
    it (the position of this rank's contiguous part of the sequence) and the group's size."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> ContextShard:
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    def __deepcopy__(self, memo: dict) -> ContextShard:  # a module copied with its hooks shares the process group
        return self

    def offset(self, local_length: int) -> int:
        """The global position of this rank's first token when each rank holds ``local_length`` of them."""
        return self.rank * local_length



def _exchange(x: torch.Tensor, shard: ContextShard, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one part per rank, send part ``j`` to rank ``j``, and concatenate what
    every rank sent, in rank order, along ``gather_dim``."""
    if x.size(scatter_dim) % shard.size:
        from lightning_hybrid.config import HybridConfigError

        raise HybridConfigError(
            f"`context_parallel_size={shard.size}` must divide the attention's heads on each tensor-parallel rank"
            f" ({x.size(scatter_dim)} here; with tensor parallel, the heads / tensor_parallel_size) and the sequence"
            " length. Choose a divisor of both (docs/context-parallel.md)."
        )
    parts = [p.contiguous() for p in x.chunk(shard.size, dim=scatter_dim)]
    received = all_to_all([torch.empty_like(p) for p in parts], parts, group=shard.group)
    return torch.cat(received, dim=gather_dim)


def heads_to_sequence(x: torch.Tensor, shard: ContextShard, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """``[.., heads, seq / cp, ..]`` (this rank's tokens, every head) to ``[.., heads / cp, seq, ..]`` (every token,
    this rank's heads): the exchange before attention."""
    return _exchange(x, shard, scatter_dim=head_dim, gather_dim=seq_dim)


def sequence_to_heads(x: torch.Tensor, shard: ContextShard, head_dim: int = 2, seq_dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`, on attention's output ``[batch, seq, heads / cp, dim]`` by default:
    back to ``[batch, seq / cp, heads, dim]``."""
    return _exchange(x, shard, scatter_dim=seq_dim, gather_dim=head_dim)
