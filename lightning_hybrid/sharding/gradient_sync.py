"""The tensor-parallel gradient sync: gradients of parameters that tensor parallel left replicated made the same on
every tensor-parallel rank (summed where each rank computed a part, averaged where each computed the whole), and
the data-parallel average of parameters ZeRO-3 leaves replicated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.dtensor import local_grad
from lightning_hybrid.sharding.flat import all_reduce_mean, flat_grads, unflatten_into

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GradientSync"]


class GradientSync:
    """Makes gradients of parameters that tensor parallel left replicated consistent across the tensor group.

    ``pairs`` are (parameter name, "avg" | "sum"): "sum" where each tensor-parallel rank computed a partial gradient
    (a replicated weight inside a split attention/MLP), "avg" where every rank computed the full one.
    """

    def __init__(
        self,
        module: nn.Module,
        pairs: list[tuple[str, str]],
        tp_mesh: Optional[DeviceMesh],
        dp_replicated: Optional[list[str]] = None,
        dp_mesh: Optional[DeviceMesh] = None,
    ) -> None:
        self.tp_mesh, self.dp_mesh = tp_mesh, dp_mesh
        named = dict(module.named_parameters())
        self.buckets = {op: [named[n] for n, o in pairs if o == op and n in named] for op in ("avg", "sum")}
        self.dp_replicated = [named[n] for n in dp_replicated or []]

    def __call__(self) -> None:
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            params = [p for p in self.dp_replicated if local_grad(p) is not None]
            if params:
                flat = flat_grads(params)
                all_reduce_mean(flat, self.dp_mesh.get_group(), self.dp_mesh.size())
                unflatten_into([local_grad(p) for p in params], flat)
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return
        group = self.tp_mesh.get_group()
        for op, params in self.buckets.items():
            params = [p for p in params if local_grad(p) is not None]
            if not params:
                continue
            flat = flat_grads(params)
            if op == "avg":
                all_reduce_mean(flat, group, self.tp_mesh.size())
            else:
                dist.all_reduce(flat, group=group)
            unflatten_into([local_grad(p) for p in params], flat)

    @torch.no_grad()
    def sync_views(self, params: list[nn.Parameter], views: list[Tensor]) -> None:
        """The tensor-parallel part of :meth:`__call__` on gradients held elsewhere than ``p.grad``: ``views[i]`` is
        ``params[i]``'s (flat) gradient, e.g. in a ZeRO-2 bucket before its data-parallel reduction. All ranks of a
        tensor-parallel group must pass the same parameters in the same order."""
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return
        group = self.tp_mesh.get_group()
        for op, members in self.buckets.items():
            ids = {id(p) for p in members}
            chosen = [v for p, v in zip(params, views) if id(p) in ids]
            if not chosen:
                continue
            flat = torch.cat([v.reshape(-1) for v in chosen])
            if op == "avg":
                all_reduce_mean(flat, group, self.tp_mesh.size())
            else:
                dist.all_reduce(flat, group=group)
            unflatten_into(chosen, flat)
