"""The all-to-all of context parallel (DeepSpeed-Ulysses): each context-parallel rank holds ``seq / cp`` tokens of
every head; before attention, q, k and v are exchanged so that each rank holds the whole sequence of ``heads / cp``
heads, attention runs with the ordinary mask over the whole sequence, and its output is exchanged back.

Written here rather than taken from torch: ``torch.distributed.tensor.experimental.context_parallel`` shards SDPA's
own kernels, and the CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) has no sharding rule (torch
2.11-2.13: NotImplementedError), while the head exchange composes with any attention kernel and any mask. The
differentiable exchange is written here too: torch's ``torch.distributed.nn.functional.all_to_all`` falls back under
gloo to scatters addressed by global rank, which fail in a subgroup, and its ``all_to_all_single`` is deprecated for a
private module; ``dist.all_to_all_single`` runs on gloo and NCCL alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

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


def _all_to_all(x: torch.Tensor, shard: ContextShard, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one part per rank, send part ``j`` to rank ``j``, and concatenate what
    every rank sent, in rank order, along ``gather_dim`` (one ``all_to_all_single`` over the parts stacked)."""
    parts = torch.stack(x.chunk(shard.size, dim=scatter_dim))
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=shard.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Exchange(torch.autograd.Function):
    """The all-to-all as an autograd function: its backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: ContextShard, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.shard, ctx.dims = shard, (scatter_dim, gather_dim)
        return _all_to_all(x, shard, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.shard, gather_dim, scatter_dim), None, None, None


def _exchange(x: torch.Tensor, shard: ContextShard, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if x.size(scatter_dim) % shard.size:
        from lightning_hybrid.config import HybridConfigError

        raise HybridConfigError(
            f"`context_parallel_size={shard.size}` must divide the attention's heads on each tensor-parallel rank"
            f" ({x.size(scatter_dim)} here; with tensor parallel, the heads / tensor_parallel_size) and the sequence"
            " length. Choose a divisor of both (docs/context-parallel.md)."
        )
    return _Exchange.apply(x, shard, scatter_dim, gather_dim)


def heads_to_sequence(x: torch.Tensor, shard: ContextShard, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """``[.., heads, seq / cp, ..]`` (this rank's tokens, every head) to ``[.., heads / cp, seq, ..]`` (every token,
    this rank's heads): the exchange before attention."""
    return _exchange(x, shard, scatter_dim=head_dim, gather_dim=seq_dim)


def sequence_to_heads(x: torch.Tensor, shard: ContextShard, head_dim: int = 2, seq_dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`, on attention's output ``[batch, seq, heads / cp, dim]`` by default:
    back to ``[batch, seq / cp, heads, dim]``."""
    return _exchange(x, shard, scatter_dim=seq_dim, gather_dim=head_dim)
