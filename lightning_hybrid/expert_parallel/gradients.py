"""The data-parallel reduction of expert weights. An expert-parallel rank's expert gradient already sums what every
rank of its expert-parallel group sent it (the all-to-all's backward); the ranks that hold the same experts (the
expert-data-parallel group, ``dp / ep`` of them) then sum theirs, and the total is divided by the whole data-parallel
size, as the dense weights' average is: every rank's loss counts once, as in the single-device mean."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.dtensor import local_grad, local_tensor
from lightning_hybrid.sharding.flat import flat_grads, unflatten_into

__all__ = ["ExpertGradientSync"]


class ExpertGradientSync:
    """Sum expert gradients over ``group`` (the ranks holding the same experts) and divide by ``data_parallel_size``.

    Example:
        >>> # sync = ExpertGradientSync(expert_params, expert_mesh["expert_data"].get_group(), data_parallel_size=4)
        >>> # sync()   # after the last backward of a step, on every rank
    """

    def __init__(self, params: list[nn.Parameter], group: Any, data_parallel_size: int) -> None:
        self.params, self.group, self.data_parallel_size = params, group, data_parallel_size
        self.expert_parallel_size = data_parallel_size // dist.get_world_size(group)
        self.ids = {id(p) for p in params}

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.params:  # a pipeline stage without MoE layers; its whole group holds the same stage
            return
        for p in self.params:  # every rank of the group reduces the same elements
            if local_grad(p) is None:
                p.grad = torch.zeros_like(p)
        flat = flat_grads(self.params)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.data_parallel_size)
        unflatten_into([local_grad(p) for p in self.params], flat)

    def __contains__(self, p: nn.Parameter) -> bool:
        return id(p) in self.ids

    def local_numel(self) -> int:
        return sum(local_tensor(p).numel() for p in self.params)
