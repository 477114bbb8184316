"""The parallel styles torch lacks, and the translation of Hugging Face's plan style names into torch's styles.

torch's ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel``/``PrepareModuleOutput`` cover most of what a
plan needs. Written here are only the layouts they cannot express: a column-wise split of a *fused* projection
(q|k|v or gate|up in one Linear), a module that computes on the local shards of its own parameters (transformers'
``local_params`` and ``moe_tp_experts``: 3-D expert weights have no ``nn.Linear`` to hook), and a module whose input
is scaled by the tensor-parallel size; and the column- and row-wise split of transformers' ``Conv1D`` (GPT-2), which
is ``nn.Linear`` with its weight stored transposed.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_hybrid._torch_compat import colwise_input_fn, strided_shard, style_output_fn
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import local_parameters

__all__ = [
    "Conv1DColwiseParallel",
    "Conv1DRowwiseParallel",
    "FusedColwiseParallel",
    "GradientSum",
    "LocalShardParallel",
    "RopeGradientSumParallel",
    "ScaleInputParallel",
    "is_conv1d",
    "is_projection",
    "parameter_placement",
    "projection_features",
    "split_style",
    "style_from_name",
]


def _map_tensors(fn: Any, value: Any) -> Any:
    """``fn`` on the tensors of ``value`` and of its tuples, lists and dicts (a forward's arguments or outputs)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return fn(value)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2, GPT, ...): ``x @ weight + bias`` with ``weight`` of shape
    ``(in_features, out_features)``, i.e. ``nn.Linear`` with its weight transposed. Read by structure (the class name
    and the ``nf``/``nx`` sizes it keeps), so that the package does not import transformers.

    Example:
        >>> is_conv1d(nn.Linear(2, 3))
        False
    """
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def is_projection(module: nn.Module) -> bool:
    """``nn.Linear`` or transformers' ``Conv1D``: the layers a tensor-parallel plan splits column- or row-wise.

    Example:
        >>> is_projection(nn.Linear(2, 3)), is_projection(nn.LayerNorm(3))
        (True, False)
    """
    return isinstance(module, nn.Linear) or is_conv1d(module)


def projection_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``.

    Example:
        >>> projection_features(nn.Linear(2, 3))
        (2, 3)
    """
    if is_conv1d(module):
        return int(module.nx), int(module.nf)
    return module.in_features, module.out_features


def _shard_parameters(module: nn.Module, device_mesh: Any, placements: dict[str, Placement], src: Any) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, device_mesh, [placements[pname]], src_data_rank=src)
        module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


def _partition_fn(placements: dict[str, Placement], src: Any) -> Any:
    """A ``distribute_module`` partition function sharding a module's own parameters by name."""
    return lambda name, module, device_mesh: _shard_parameters(module, device_mesh, placements, src)


class Conv1DColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for transformers' ``Conv1D``: its weight is ``(in, out)``, so the output features
    are its dim 1 (``nn.Linear``'s dim 0); the bias is split on its only dim. Inputs and outputs are laid out as for
    ``nn.Linear`` (torch's own hooks), and the layer's own forward runs on DTensors (``addmm`` of a replicated input
    and a column-sharded weight is a sharded output, no collective).

    Example:
        >>> style = Conv1DColwiseParallel()
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        partition = _partition_fn({"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)
        return distribute_module(module, device_mesh, partition, colwise_input_fn(self), style_output_fn(self))


class Conv1DRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for transformers' ``Conv1D``: the weight's input features are its dim 0
    (``nn.Linear``'s dim 1); the bias is replicated and the partial outputs are summed, as for ``nn.Linear``.

    Example:
        >>> style = Conv1DRowwiseParallel()
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        partition = _partition_fn({"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)
        return distribute_module(module, device_mesh, partition, colwise_input_fn(self), style_output_fn(self))


def split_style(kind: str, module: nn.Module, **layouts: Any) -> ParallelStyle:
    """torch's ``ColwiseParallel`` (``kind="colwise"``) or ``RowwiseParallel`` (``"rowwise"``) for ``module``, or
    their ``Conv1D`` variants where ``module`` is a transformers ``Conv1D``.

    Example:
        >>> type(split_style("rowwise", nn.Linear(4, 4))).__name__
        'RowwiseParallel'
    """
    conv1d = is_conv1d(module)
    if kind == "colwise":
        return (Conv1DColwiseParallel if conv1d else ColwiseParallel)(**layouts)
    return (Conv1DRowwiseParallel if conv1d else RowwiseParallel)(**layouts)


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise split of a fused projection whose output is ``num_blocks`` equal blocks (e.g. q|k|v).

    torch's ``ColwiseParallel`` cuts the weight into contiguous row ranges, which for a fused q|k|v weight hands rank 0
    all of q and part of k. Here each block is split separately (DTensor's strided sharding), so every rank holds
    ``[q_r | k_r | v_r]`` and code like ``q, k, v = c_attn(x).chunk(3, dim=-1)`` stays correct.

    The layer computes on its local tensors (:func:`_local_linear_forward`): the product needs no collective, and
    torch 2.11's DTensor cannot redistribute a strided shard, which its matmul rules would ask for.

    Example:
        >>> style = FusedColwiseParallel(num_blocks=3)
    """

    def __init__(self, *, num_blocks: int, use_local_output: bool = True) -> None:
        super().__init__(use_local_output=use_local_output)
        self.num_blocks = num_blocks

    def _partition_fused(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        # the output features: dim 0 of nn.Linear's weight, dim 1 of Conv1D's (stored transposed); the bias's only dim
        weight_dim = 1 if is_conv1d(module) else 0
        placements = {p: strided_shard(weight_dim if p == "weight" else 0, self.num_blocks) for p, _ in
                      module.named_parameters(recurse=False)}  # fmt: skip
        _shard_parameters(module, device_mesh, placements, self.src_data_rank)

    def _prepare_output(self, mod: nn.Module, outputs: Tensor, device_mesh: Any) -> Any:
        # the local output is already [q_r | k_r | v_r]: no redistribution
        if self.use_local_output:
            return outputs
        placement = strided_shard(outputs.dim() - 1, self.num_blocks)
        return DTensor.from_local(outputs, device_mesh, [placement], run_check=False)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not is_projection(module):
            raise HybridConfigError(
                f"FusedColwiseParallel (the 'fused_colwise_<k>' or 'packed_colwise' style) splits nn.Linear (and"
                f" transformers' Conv1D) layers only, not {type(module).__name__}. Give that module another style in"
                " `tensor_parallel_plan`."
            )
        distribute_module(module, device_mesh, self._partition_fused, colwise_input_fn(self), self._prepare_output)
        module.forward = MethodType(_local_linear_forward, module)
        return module


def _local_linear_forward(self: nn.Module, input: Any) -> Tensor:
    """``nn.Linear.forward`` (or ``Conv1D.forward``) of a fused column-parallel layer, on local tensors:
    ``x @ W_r^T + b_r`` is this rank's ``[q_r | k_r | v_r]``. The weight's and bias's gradients come back laid out
    like them; the input's gradient here is this rank's heads' share only, so it is marked ``Partial`` and the input
    hook's DTensor sums it over the tensor-parallel ranks in backward (the all-reduce a DTensor matmul would have
    done)."""
    if isinstance(input, DTensor):
        input = input.to_local(grad_placements=[Partial()] * input.device_mesh.ndim)
    bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
    weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
    if is_conv1d(self):  # Conv1D's own computation, with this rank's output width instead of its `nf`
        out = torch.addmm(bias, input.reshape(-1, input.size(-1)), weight)
        return out.view(*input.shape[:-1], weight.shape[1])
    return F.linear(input, weight, bias)


def _gradient_summed_over(x: Tensor, device_mesh: Any) -> Tensor:
    """``x`` unchanged in forward; in backward its gradient, each rank's share only, is summed over ``device_mesh``
    (read as a partial sum and made whole: an all-reduce)."""
    return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class LocalShardParallel(ParallelStyle):
    """A module that computes on the local shards of its parameters: transformers' ``local_params`` and, with
    ``sum_output=True``, ``moe_tp_experts`` (each rank runs its slice of every expert's hidden size; the partial outputs
    are summed over the tensor-parallel ranks, and the replicated inputs' gradients, each rank's share, are summed in
    backward).

    ``placements`` shards the module's own parameters by name (from the plan's parameter entries, e.g.
    ``experts.gate_up_proj: packed_colwise``); the others stay replicated.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> style = LocalShardParallel({"down_proj": Shard(2)}, sum_output=True)
    """

    def __init__(self, placements: dict[str, Placement], *, sum_output: bool = False) -> None:
        super().__init__()
        self.placements = dict(placements)
        self.sum_output = sum_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, placement in self.placements.items():
            param = module.get_parameter(name)
            sharded = nn.Parameter(distribute_tensor(param.data, device_mesh, [placement]), param.requires_grad)
            module.register_parameter(name, sharded)
        forward = module.forward

        def partial_gradient(x: Any) -> Any:
            # replicated in, but each rank's backward sees only its shard's share: sum the gradient over the ranks
            if isinstance(x, Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
                return _gradient_summed_over(x, device_mesh)
            return x

        def summed(x: Any) -> Any:
            if isinstance(x, Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
                as_partial = DTensor.from_local(x, device_mesh, [Partial()], run_check=False)
                return as_partial.redistribute(device_mesh, [Replicate()]).to_local()
            return x

        def local_forward(*args: Any, **kwargs: Any) -> Any:
            if self.sum_output:
                args, kwargs = _map_tensors(partial_gradient, args), _map_tensors(partial_gradient, kwargs)
            with local_parameters(module):
                out = forward(*args, **kwargs)
            return _map_tensors(summed, out) if self.sum_output else out

        module.forward = local_forward
        return module


class ScaleInputParallel(ParallelStyle):
    """transformers' ``moe_identity_expert``: an identity expert whose output the tensor-parallel sum of
    ``moe_tp_experts`` would count ``tp`` times gets its input divided by ``tp``.

    Example:
        >>> style = ScaleInputParallel()
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        size = device_mesh.size()

        def scale(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (args[0] / size, *args[1:])

        module.register_forward_pre_hook(scale)
        return module


class RopeGradientSumParallel(ParallelStyle):
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3; transformers' ``mla_kv_a_proj``): the
    layer stays replicated, and the gradient of the last ``rope_dim`` output features is summed over the
    tensor-parallel ranks in backward. Those features (the keys' rotary part) go straight to attention, shared by every
    head, so each rank's backward holds only its own heads' share; the other features pass through the column-wise
    ``kv_b_proj``, whose input gradient torch already sums. Written here because torch has no style that reduces part
    of an output's gradient.

    Example:
        >>> RopeGradientSumParallel(rope_dim=64).rope_dim
        64
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        rope_dim = self.rope_dim

        def sum_rope_gradient(mod: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
            passed, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([passed, _gradient_summed_over(rope, device_mesh)], dim=-1)

        module.register_forward_hook(sum_rope_gradient)
        return module


class GradientSum:
    """Marks a module whose replicated parameters see only this rank's share of a split (transformers'
    ``replicated_with_grad_allreduce``, e.g. Qwen3's per-head ``q_norm``): their gradients are summed over the
    tensor-parallel ranks by the strategy's replicated-gradient reduction, not averaged. Not a torch style: nothing
    changes in the forward."""


# transformers 5's style names (`transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES`) that are refused, and
# why: each names what the user can do instead
REFUSED_STYLES = {
    "grouped_gemm": "it is an expert-parallel style (experts spread over ranks), not a tensor-parallel one: spread the"
    " experts with `expert_parallel_size`, or split them over the tensor ranks with 'moe_tp_experts' and"
    " 'packed_colwise'/'rowwise' on their weights",
    "ep_dispatch_experts": "it is an expert-parallel style (token dispatch to experts on other ranks), not a"
    " tensor-parallel one: spread the experts with `expert_parallel_size`, or split them with 'moe_tp_experts'",
}


def style_from_name(
    style: str,
    name: str,
    module: nn.Module,
    placements: Optional[dict[str, Placement]] = None,
    rope_dim: Optional[int] = None,
) -> Any:
    """The torch style for a plan entry naming a *module*: a ``ParallelStyle``, :class:`GradientSum`, or ``None``
    (the module stays replicated). ``placements`` are the module's own parameters sharded by parameter entries;
    ``rope_dim``: the rotary key features of a multi-head latent attention's ``kv_a_proj_with_mqa`` (``mla_kv_a_proj``).

    Example:
        >>> from torch import nn
        >>> type(style_from_name("rowwise_split_input", "o_proj", nn.Linear(4, 4))).__name__
        'RowwiseParallel'
    """
    placements = placements or {}
    if placements and style not in ("local_params", "moe_tp_experts"):
        raise HybridConfigError(
            f"`tensor_parallel_plan` shards parameters of {name!r} ({', '.join(placements)}) but gives the module"
            f" the style {style!r}: a module whose own parameters are split needs 'local_params' or 'moe_tp_experts'."
        )
    # transformers' per-head splits (5.25), which replicate heads when there are fewer than ranks: the plan's head-count
    # check refuses that case, and with whole heads on every rank they are the plain column- and row-wise splits
    style = {"unit_colwise": "colwise", "unit_rowwise": "rowwise"}.get(style, style)
    linear, embedding = is_projection(module), isinstance(module, nn.Embedding)
    if style == "mla_kv_a_proj":
        if rope_dim is None:
            raise HybridConfigError(
                f"`tensor_parallel_plan` gives {name!r} the style 'mla_kv_a_proj', but its attention module has no"
                " `qk_rope_head_dim` (nor a config with one): the number of rotary key features whose gradient is"
                " summed over the tensor ranks is unknown. Leave the attention replicated (drop its entries)."
            )
        return RopeGradientSumParallel(rope_dim)
    if style in ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_split_input", "rowwise_rep"):
        if not (linear or embedding):
            raise HybridConfigError(
                f"`tensor_parallel_plan` gives {name!r} ({type(module).__name__}) the style {style!r}, which splits"
                " nn.Linear, transformers' Conv1D and nn.Embedding layers only. Name the Linear layers inside it"
                " instead."
            )
        if style in ("colwise", "rowwise"):
            return split_style(style, module)
        if style in ("colwise_rep", "colwise_gather_output"):  # a split closed within the layer: output gathered
            return split_style("colwise", module, output_layouts=Replicate())
        return split_style("rowwise", module, input_layouts=Replicate())  # the layer slices its replicated input
    if style in ("embedding_rowwise", "vocab_parallel_embedding"):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "packed_colwise" or style.startswith("fused_colwise_"):
        blocks = 2 if style == "packed_colwise" else int(style.rsplit("_", 1)[1])
        return FusedColwiseParallel(num_blocks=blocks)
    if style == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    if style == "all_reduce":  # the module's output is a partial sum: all-reduce it
        return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate(), use_local_output=True)
    if style in ("local_params", "moe_tp_experts"):
        return LocalShardParallel(placements, sum_output=style == "moe_tp_experts")
    if style == "moe_identity_expert":
        return ScaleInputParallel()
    if style == "replicated_with_grad_allreduce":
        return GradientSum()
    if style == "replicate":
        return None
    if style in REFUSED_STYLES:
        raise HybridConfigError(f"`tensor_parallel_plan` gives {name!r} the style {style!r}: {REFUSED_STYLES[style]}.")
    if style == "packed_rowwise":
        raise HybridConfigError(
            f"`tensor_parallel_plan` gives the module {name!r} the style 'packed_rowwise', which splits a parameter"
            " (packed along its input dimension), not a module: name the parameter, and give its module"
            " 'local_params' or 'moe_tp_experts'."
        )
    raise HybridConfigError(
        f"`tensor_parallel_plan` gives {name!r} the style {style!r}, which is not one of {sorted(KNOWN_STYLES)}. Use"
        " one of these or a torch ParallelStyle object."
    )


def parameter_placement(style: str, name: str, param: Tensor) -> Union[Placement, None]:
    """The placement for a plan entry naming a *parameter* (transformers shards 3-D expert weights this way), or
    ``None`` to leave it replicated.

    Example:
        >>> import torch
        >>> parameter_placement("rowwise", "experts.down_proj", torch.empty(4, 8, 16))
        Shard(dim=2)
    """
    last, ndim = param.dim() - 1, param.dim()
    if style == "colwise":
        return Shard(max(ndim - 2, 0))
    if style == "rowwise":
        return Replicate() if ndim == 1 else Shard(last)
    if style == "packed_colwise":
        return strided_shard(max(ndim - 2, 0), 2)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else strided_shard(last, 2)
    if style in ("embedding_rowwise", "vocab_parallel_embedding"):
        return Shard(0)
    if style == "replicate":
        return None
    raise HybridConfigError(
        f"`tensor_parallel_plan` gives the parameter {name!r} the style {style!r}; parameters take 'colwise',"
        " 'rowwise', 'packed_colwise', 'packed_rowwise', 'embedding_rowwise' or 'replicate'."
    )


# Every style name a plan may give as a string (transformers 5's, plus lightning-hybrid's 'fused_colwise_<k>')
KNOWN_STYLES = {
    "colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "vocab_parallel_embedding", "embedding_colwise", "packed_colwise", "packed_rowwise",
    "sequence_parallel", "all_reduce", "local_params", "moe_tp_experts", "moe_identity_expert",
    "replicated_with_grad_allreduce", "replicate", "fused_colwise_<k>", "unit_colwise", "unit_rowwise",
    "mla_kv_a_proj", *REFUSED_STYLES,
}  # fmt: skip


def region_role(style: Any) -> Optional[str]:
    """``"col"`` for a split whose output stays sharded (it opens a tensor-parallel region), ``"row"`` for one whose
    input arrives sharded (it closes one), ``None`` for a split closed within the layer (gathered output, or a
    replicated input the layer slices itself)."""
    if isinstance(style, FusedColwiseParallel):
        return "col"
    if isinstance(style, ColwiseParallel):
        return "col" if style.output_layouts == (Shard(-1),) else None
    if isinstance(style, RowwiseParallel):
        return "row" if style.input_layouts == (Shard(-1),) else None
    return None
