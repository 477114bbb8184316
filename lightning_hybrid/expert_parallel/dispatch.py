"""Expert parallel applied: each experts module's packed weights sharded over the expert-parallel ranks (the expert
dimension, ``Shard(0)``), and hooks around its forward so that every (token, chosen expert) pair travels to the rank
holding that expert and its output comes back, by all-to-all (Megatron's and torchtitan's token dispatch).

The experts' own forward computes on the pairs a rank receives, with its local experts: the model's activation,
gating and the multiplication by the routing weight are its own code. Each pair's output is added into its token on
the sending rank, as the module adds a token's top-k outputs on one device. The module's ``forward`` is left as it
is: a forward pre-hook dispatches (its arguments become the pairs this rank received), a forward hook combines (its
output becomes the tokens' sums), both registered once, at set-up.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_hybrid._torch_compat import all_to_all_autograd, inside_backward
from lightning_hybrid.dtensor import local_parameters
from lightning_hybrid.expert_parallel.discover import EXPERT_COUNT_ATTRIBUTES, ExpertModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertDispatch", "ExpertLoad", "ExpertShards", "apply_expert_parallel", "shard_experts"]


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
        """Count the expert index of every routed pair in ``experts``."""
        if self.counting and not inside_backward():
            self.add_counts(name, torch.bincount(experts.detach(), minlength=num_experts))

    def add_counts(self, name: str, counts: Tensor) -> None:
        """Count the pairs routed to each expert (``counts[e]``: those of expert ``e``)."""
        if not self.counting or inside_backward():
            return
        counts = counts.detach()
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
        count = functools.partial(load.add_counts, expert.name)
        ExpertDispatch(sub, expert.num_experts, ep_mesh.get_group(), ep, count)
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


class _GradientScale(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


@dataclass
class _Call:
    """One forward call between the dispatch's two hooks."""

    hidden_states: Tensor
    token: Tensor
    send: list[int]
    receive: list[int]
    contexts: ExitStack


class ExpertDispatch:
    """Expert parallel around one experts module, ``module(hidden_states, top_k_index, top_k_weights, ...)``: its
    tokens go to the ranks holding their experts (``num_experts`` in all, ``num_experts / ep`` on each rank of
    ``group``) and come back summed. ``count`` is given the pairs routed to each expert (the load the monitor logs).

    Two hooks on the module, registered here once: a forward pre-hook that sends each pair to its expert's rank and
    gives the module the pairs this rank received (with its local experts' weights in place, see
    :func:`~lightning_hybrid.dtensor.local_parameters`); a forward hook that sends the outputs back and adds each
    pair's into its token. One metadata exchange per call: the pairs per expert, from which every rank knows the
    rows it receives and their local expert (the sender orders its pairs by expert).

    Example:
        >>> # ExpertDispatch(model.get_submodule("layers.0.mlp.experts"), 8, ep_mesh.get_group(), 2, load.add_counts)
        >>> # model(tokens)   # the experts module's calls now dispatch and combine through its two hooks
    """

    def __init__(
        self, module: nn.Module, num_experts: int, group: Any, ep: int, count: Callable[[Tensor], None]
    ) -> None:
        self.module, self.num_experts, self.group, self.ep, self.count = module, num_experts, group, ep, count
        self.per_rank = num_experts // ep
        self.weight_names = [name for name, _ in module.named_parameters(recurse=False)]
        # the forward's first three parameters by name (a caller may pass them as keywords)
        self.argument_names = list(inspect.signature(type(module).forward).parameters)[1:4]
        self._calls: list[_Call] = []  # a stack: the pre-hook pushes, the hook pops
        module.register_forward_pre_hook(self._dispatch, with_kwargs=True)
        module.register_forward_hook(self._combine, always_call=True)

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[list[Any], tuple, dict]:
        """(hidden_states, top_k_index, top_k_weights), the other positional arguments, the other keywords."""
        kwargs = dict(kwargs)
        routing = list(args[:3]) + [kwargs.pop(name) for name in self.argument_names[len(args[:3]) :]]
        return routing, args[3:], kwargs

    @torch.no_grad()
    def _plan(self, experts: Tensor) -> tuple[Tensor, list[int], list[int], Tensor]:
        """The pairs per expert exchanged (one all-to-all); the rows sent to / received from each rank, and the
        local expert of each row received (from rank s: its pairs of my expert 0, then 1, ...)."""
        per_expert = torch.bincount(experts, minlength=self.num_experts)
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=self.group)
        received = received.view(self.ep, self.per_rank)
        sizes = torch.stack([per_expert.view(self.ep, self.per_rank).sum(1), received.sum(1)]).tolist()
        local = torch.arange(self.per_rank, device=experts.device).repeat(self.ep)
        local_ids = local.repeat_interleave(received.reshape(-1))
        return per_expert, sizes[0], sizes[1], local_ids

    def _dispatch(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        (hidden_states, top_k_index, top_k_weights), rest, kwargs = self._arguments(args, kwargs)
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        k = top_k_index.shape[-1]
        experts, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
        # a slot the model routes nowhere (an index outside its experts: dropped by capacity) contributes nothing,
        # as the module's own loop over experts skips it
        routed = (experts >= 0) & (experts < self.num_experts)
        experts, weights, token = experts[routed], weights[routed], token[routed]
        # ordered by expert, so by the rank holding it: each rank receives its pairs grouped by its local expert
        order = torch.argsort(experts, stable=True)
        experts, weights, token = experts[order], weights[order], token[order]
        per_expert, send, receive, local_ids = self._plan(experts)
        self.count(per_expert)
        rows = all_to_all_autograd(hidden[token].contiguous(), receive, send, self.group)
        row_weights = all_to_all_autograd(weights.unsqueeze(1), receive, send, self.group)
        contexts = ExitStack()
        try:
            contexts.enter_context(local_parameters(module))
            contexts.enter_context(_local_expert_count(module, self.num_experts, self.per_rank))
            for name in self.weight_names:
                # a local expert's gradient sums what its ep peers' tokens gave it: 1/ep makes the average over the
                # ranks holding the same experts (ZeRO's, FSDP2's) the average over all dp ranks, as for dense
                # weights (torchtitan sets FSDP2's divide factor instead; NCCL-only, and on torch 2.13 applied twice
                # in a group of one). A node of this forward's graph, not a hook registered per forward.
                weight = getattr(module, name)
                if weight.requires_grad:
                    setattr(module, name, _GradientScale.apply(weight, 1.0 / self.ep))
        except BaseException:
            contexts.close()
            raise
        self._calls.append(_Call(hidden_states, token, send, receive, contexts))
        return (rows, local_ids.unsqueeze(1), row_weights, *rest), kwargs

    def _combine(self, module: nn.Module, args: tuple, out: Any) -> Optional[Tensor]:
        if not self._calls:  # the pre-hook itself failed: nothing was entered
            return None
        call = self._calls.pop()
        with call.contexts:
            if not isinstance(out, Tensor):  # the forward raised: put the module back, let the error through
                return None
            if out.shape[0] == 0:
                # no pair came here: every local weight still gets its (zero) gradient, as the packed weights do on
                # one device whenever any expert is used, so the optimizer treats the shard as it treats the whole
                out = out + sum(getattr(module, n).reshape(-1)[:1].sum() for n in self.weight_names) * 0
        back = all_to_all_autograd(out.contiguous(), call.send, call.receive, self.group)
        # the tokens' sums in a tensor of the output's own shape, not a view: FSDP2 hooks its backward on the output,
        # and an in-place op of the model on a returned view would drop that hook
        hidden_states = call.hidden_states
        combined = hidden_states.new_zeros(hidden_states.shape)
        combined.view(-1, hidden_states.shape[-1]).index_add_(0, call.token, back.to(hidden_states.dtype))
        return combined
