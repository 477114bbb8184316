"""The global gradient norm across tensor, pipeline and data (ZeRO) shards, and clipping by it.

Every rank adds the squares of the gradient elements it holds, each weighted by one over the number of ranks that
hold an identical copy of that element, and one all-reduce over all ranks sums them: so each element of the model
counts exactly once, whatever the layout, as in the single-device norm. torch's ``clip_grad_norm_`` handles DTensor
shards within one mesh, but not copies replicated across tensor-parallel ranks as plain tensors, nor pipeline stages
or ZeRO-1/2 flat shards, hence this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.dtensor import local_grad
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GradientNorm"]


def _tensor_parallel_copies(p: nn.Parameter, tp: int) -> int:
    """How many tensor-parallel ranks hold the same elements of ``p`` (1 if split over them, else tp)."""
    if tp == 1:
        return 1
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        if "tensor" in names:
            placement = p.placements[names.index("tensor")]
            return tp if placement.is_replicate() else 1
    return tp


@dataclass
class _Segment:
    start: int
    end: int
    weight: float


class GradientNorm:
    """Computes the global norm of the gradients the optimizers will step on, and clips them.

    ``duplicates`` are parameters whose gradient another pipeline stage also holds (a tied embedding's second copy):
    they are left out of the norm (weight 0) but still clipped.

    Example:
        >>> # norm = GradientNorm(module, sharded_optimizers, mesh, zero_stage=1)
        >>> # total = norm.clip_(max_norm=1.0)   # collective: every rank calls it
    """

    def __init__(
        self,
        module: nn.Module,
        sharded: list[ShardedOptimizer],
        mesh: DeviceMesh,
        zero_stage: int,
        duplicates: Iterable[nn.Parameter] = (),
    ) -> None:
        self.module, self.sharded, self.zero_stage = module, sharded, zero_stage
        self.tp, self.dp = mesh["tensor"].size(), mesh["data"].size()
        # how many data-parallel ranks hold each parameter whole at ZeRO-0: its flat group's ranks (all dp, or for an
        # expert shard the dp / ep ranks holding the same experts)
        self.data_copies = {id(p): g.ranks.size for z in sharded for g in z.groups for p in g.params}
        skip = {id(p) for p in duplicates}
        self.weights = {
            id(p): 0.0 if id(p) in skip else 1.0 / _tensor_parallel_copies(p, self.tp) for p in module.parameters()
        }
        self.segments = [self._segments(z) for z in sharded]

    def _segments(self, zero: ShardedOptimizer) -> list[list[_Segment]]:
        """Per flat group, the weighted pieces of this rank's shard (a shard can span several parameters)."""
        out = []
        for group in zero.groups:
            # an unsharded master (stage 0 with low-precision parameters) is held whole by every replica of its
            # domain (all data-parallel ranks; for expert weights, those holding the same experts)
            copies = 1 if zero.sharded else group.ranks.size
            lo = group.ranks.rank * group.shard_size if zero.sharded else 0
            hi = lo + group.shard_size
            pieces, offset = [], 0
            for p in group.params:
                n = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                start, end = max(offset, lo), min(offset + n, hi)
                if start < end:
                    pieces.append(_Segment(start - lo, end - lo, self.weights.get(id(p), 1.0) / copies))
                offset += n
            out.append(pieces)
        return out

    def _gradients(
        self, sharded: Optional[ShardedOptimizer] = None, parameters: Optional[set[int]] = None
    ) -> list[tuple[Tensor, Optional[list[_Segment]], float]]:
        """(local gradient, weighted segments or None, weight) for every gradient the optimizers step on; only
        ``sharded``'s, or only those of ``parameters`` (ids), when given (one optimizer of several)."""
        out: list[tuple[Tensor, Optional[list[_Segment]], float]] = []
        if self.sharded and all(z.uses_masters for z in self.sharded):
            for zero, segments in zip(self.sharded, self.segments):
                if sharded is not None and zero is not sharded:
                    continue
                for group, pieces in zip(zero.groups, segments):
                    if group.master is not None and group.master.grad is not None:
                        out.append((group.master.grad, pieces, 1.0))
            return out
        if sharded is not None:
            parameters = {id(p) for p in sharded.model_parameters}
        # ZeRO-0: every data-parallel replica holds the full gradient; ZeRO-3: FSDP2 shards it, except parameters it
        # was told to ignore (replicated over data)
        for p in {id(p): p for p in self.module.parameters()}.values():
            grad = local_grad(p)
            if grad is None or (parameters is not None and id(p) not in parameters):
                continue
            replicated_over_data = self.zero_stage == 0 or not _sharded_over_data(p)
            copies = self.data_copies.get(id(p), self.dp) if replicated_over_data else 1
            weight = self.weights.get(id(p), 1.0) / copies
            out.append((grad, None, weight))
        return out

    def gradients(self) -> list[Tensor]:
        """Every gradient tensor the optimizers will step on, on this rank (to unscale, clip or check)."""
        return [grad for grad, _, _ in self._gradients()]

    @torch.no_grad()
    def total(self, sharded: Optional[ShardedOptimizer] = None, parameters: Optional[set[int]] = None) -> float:
        """The global L2 norm (a collective over all ranks); of one optimizer's gradients with ``sharded`` or
        ``parameters`` (see ``_gradients``)."""
        device = next(self.module.parameters()).device
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for grad, pieces, weight in self._gradients(sharded, parameters):
            g = grad.double()
            if pieces is None:
                squares += weight * g.pow(2).sum()
            else:
                for piece in pieces:
                    squares += piece.weight * g[piece.start : piece.end].pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(squares)
        return math.sqrt(max(squares.item(), 0.0))

    @torch.no_grad()
    def clip_(
        self,
        max_norm: float,
        eps: float = 1e-6,
        norm: Optional[float] = None,
        sharded: Optional[ShardedOptimizer] = None,
        parameters: Optional[set[int]] = None,
    ) -> float:
        """Scale every gradient by ``min(1, max_norm / (norm + eps))`` (torch's formula); returns the norm.

        ``norm``: the global norm if the caller has just computed it for these gradients (saves a collective);
        ``sharded``/``parameters``: one optimizer's gradients only (see ``_gradients``)."""
        norm = self.total(sharded, parameters) if norm is None else norm
        coefficient = max_norm / (norm + eps)
        if coefficient < 1.0:
            for grad, _, _ in self._gradients(sharded, parameters):
                grad.mul_(coefficient)
        return norm


def _sharded_over_data(p: nn.Parameter) -> bool:
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    # "expert_data": expert weights, which FSDP2 shards over the ranks holding the same experts
    dim = next((names.index(n) for n in ("data", "expert_data") if n in names), None)
    return dim is not None and not p.placements[dim].is_replicate()
