"""Expert parallel applied: each experts module's packed weights sharded over the expert-parallel ranks (the expert
dimension, ``Shard(0)``), and its forward wrapped so that every (token, chosen expert) pair travels to the rank
holding that expert and its output comes back, by all-to-all (Megatron's and torchtitan's token dispatch).

The experts' own forward computes on the pairs a rank receives, with its local experts: the model's activation,
gating and the multiplication by the routing weight are its own code. Each pair's output is added into its token on
the sending rank, as the module adds a token's top-k outputs on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_hybrid._torch_compat import all_to_all_autograd, inside_backward
from lightning_hybrid.dtensor import local_parameters
from lightning_hybrid.expert_parallel.discover import EXPERT_COUNT_ATTRIBUTES, ExpertModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertLoad", "ExpertShards", "apply_expert_parallel", "dispatched_forward", "shard_experts"]


class ExpertLoad:
    """Tokens routed to each expert, per experts module, counted by the dispatch while :attr:`counting` (the monitor
    turns it on for the steps it logs): the (token, expert) pairs of this rank's own tokens, by the expert's index in
    the whole layer. Summed over the data-parallel ranks (one tensor-parallel rank of each: its peers route the same
    tokens) they are the layer's load. A forward recomputed in the backward (activation checkpointing) is not
    counted again.

    Example:
        >>> load = ExpertLoad()
        >>> load.counting = True
        >>> load.add("layers.0.mlp.experts", torch.tensor([0, 3, 3, 1]), num_experts=4)
        >>> load.take()
        {'layers.0.mlp.experts': [1, 1, 0, 2]}
    """

    def __init__(self) -> None:
        self.counting = False
        self._tokens: dict[str, Tensor] = {}

    def add(self, name: str, experts: Tensor, num_experts: int) -> None:
        if not self.counting or inside_backward():
            return
        counts = torch.bincount(experts.detach(), minlength=num_experts)
        self._tokens[name] = self._tokens[name] + counts if name in self._tokens else counts

    def take(self) -> dict[str, list[int]]:
        """The counts so far (plain lists, to gather), forgotten here."""
        tokens, self._tokens = self._tokens, {}
        return {name: counts.tolist() for name, counts in tokens.items()}


@dataclass(frozen=True)
class ExpertShards:
    """What expert parallel split on this rank: the expert weights it holds (DTensors, ``Shard(0)`` over the
    expert-parallel ranks), the experts modules, and the expert mesh (``("pipeline", "expert_data", "expert",
    "tensor")``), whose ``expert_data`` ranks hold the same experts and reduce their gradients together; and the
    tokens each expert received (:class:`ExpertLoad`, for the monitor)."""

    params: list[nn.Parameter]
    modules: list[nn.Module]
    mesh: DeviceMesh
    load: ExpertLoad = field(default_factory=ExpertLoad)

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.params)


def apply_expert_parallel(module: nn.Module, experts: list[ExpertModule], expert_mesh: DeviceMesh) -> ExpertShards:
    """Shard each of ``experts`` over ``expert_mesh["expert"]`` and make its forward dispatch tokens.

    Example:
        >>> # experts, refused = find_expert_modules(model)
        >>> # shards = apply_expert_parallel(model, experts, expert_mesh)
    """
    ep_mesh = expert_mesh["expert"]
    ep = ep_mesh.size()
    modules = []
    sharded: list[nn.Parameter] = []
    load = ExpertLoad()
    for expert in experts:  # ep divides each expert count: checked on the whole model, on every rank
        sub = module.get_submodule(expert.name)
        for name, param in list(sub.named_parameters(recurse=False)):
            # from expert-parallel rank 0's weights, as tensor parallel's shards are: one device's initialisation
            shard = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            sub.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
            sharded.append(sub.get_parameter(name))
        count = functools.partial(load.add, expert.name, num_experts=expert.num_experts)
        sub.forward = dispatched_forward(sub, sub.forward, expert.num_experts, ep_mesh.get_group(), ep, count)
        modules.append(sub)
    return ExpertShards(sharded, modules, expert_mesh, load)


def shard_experts(experts: ExpertShards, **fsdp_kwargs: Any) -> None:
    """ZeRO-3 of the expert weights: an FSDP2 unit per experts module over the ranks holding the same experts
    (``expert_data``), whose average is the one the expert gradients need (see ``dispatched_forward``)."""
    from torch.distributed.fsdp import fully_shard

    mesh = experts.mesh["expert_data"]
    for sub in experts.modules:
        fully_shard(sub, mesh=mesh, **fsdp_kwargs)


@contextmanager
def _local_expert_count(module: nn.Module, total: int, local: int) -> Iterator[None]:
    """The module's recorded expert count reads ``local`` while it computes on its local experts (its forward sizes a
    one-hot or a histogram by it)."""
    names = [a for a in EXPERT_COUNT_ATTRIBUTES if getattr(module, a, None) == total]
    for a in names:
        setattr(module, a, local)
    try:
        yield
    finally:
        for a in names:
            setattr(module, a, total)


def dispatched_forward(
    module: nn.Module,
    forward: Callable[..., Tensor],
    num_experts: int,
    group: Any,
    ep: int,
    count: Callable[[Tensor], None] = lambda experts: None,
) -> Callable[..., Tensor]:
    """``forward(hidden_states, top_k_index, top_k_weights, ...)`` of ``module`` with its tokens sent to the ranks
    holding their experts (``num_experts`` in all, ``num_experts / ep`` on each rank of ``group``); ``count`` is
    given the expert index of every routed pair (the load the monitor logs)."""
    per_rank = num_experts // ep
    weight_names = [name for name, _ in module.named_parameters(recurse=False)]

    def dispatching(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args: Any, **kwargs: Any):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        k = top_k_index.shape[-1]
        experts, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
        # a slot the model routes nowhere (an index outside its experts: dropped by capacity) contributes nothing,
        # as the module's own loop over experts skips it
        routed = (experts >= 0) & (experts < num_experts)
        experts, weights, token = experts[routed], weights[routed], token[routed]
        count(experts)
        destination = torch.div(experts, per_rank, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)
        experts, weights, token = experts[order], weights[order], token[order]
        send_counts = torch.bincount(destination, minlength=ep)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=group)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        rows = all_to_all_autograd(hidden[token].contiguous(), receive, send, group)
        row_weights = all_to_all_autograd(weights.unsqueeze(1), receive, send, group)
        local_ids = torch.empty(sum(receive), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(local_ids, experts.remainder(per_rank), receive, send, group=group)
        with local_parameters(module), _local_expert_count(module, num_experts, per_rank):
            for name in weight_names:
                # a local expert's gradient sums what its ep peers' tokens gave it: 1/ep makes the average over the
                # ranks holding the same experts (ZeRO's, FSDP2's) the average over all dp ranks, as for dense weights
                # (torchtitan sets FSDP2's divide factor instead; NCCL-only, and on torch 2.13 applied twice in a
                # group of one)
                if (weight := getattr(module, name)).requires_grad:
                    weight.register_hook(lambda grad: grad / ep)
            out = forward(rows, local_ids.unsqueeze(1), row_weights, *args, **kwargs)
            if out.shape[0] == 0:
                # no pair came here: every local weight still gets its (zero) gradient, as the packed weights do on
                # one device whenever any expert is used, so the optimizer treats the shard as it treats the whole
                out = out + sum(getattr(module, n).reshape(-1)[:1].sum() for n in weight_names) * 0
        back = all_to_all_autograd(out.contiguous(), send, receive, group)
        # the tokens' sums in a tensor of the output's own shape, not a view: FSDP2 hooks its backward on the output,
        # and an in-place op of the model on a returned view would drop that hook
        combined = hidden_states.new_zeros(hidden_states.shape)
        combined.view(-1, hidden.shape[-1]).index_add_(0, token, back.to(hidden.dtype))
        return combined

    return dispatching
