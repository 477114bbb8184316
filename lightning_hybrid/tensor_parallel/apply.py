"""Applying a tensor-parallel plan: DTensor sharding, head counts, tied weights, sequence parallel, and which replicated
parameters need their gradients made consistent across the tensor-parallel group."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_hybrid._hooks import map_first_input, map_output
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.structure import ModelStructure
from lightning_hybrid.tensor_parallel.plan import (
    HEAD_COUNT_ATTRIBUTES,
    SHARDED_WIDTH_ATTRIBUTES,
    TensorParallelPlan,
    config_head_counts,
)
from lightning_hybrid.tensor_parallel.styles import (
    Conv1DRowwiseParallel,
    FusedColwiseParallel,
    LocalShardParallel,
    is_projection,
    projection_features,
    region_role,
)
from lightning_hybrid.tensor_parallel.vocab import split_logits_hook

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_tensor_parallel", "sequence_shard_shape", "validate_tensor_parallel_plan"]

_NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith(("norm", "layernorm"))


def validate_tensor_parallel_plan(root: nn.Module, plan: TensorParallelPlan, tp: int) -> None:
    """Check every split divides evenly, before any collective runs (pure function of the model and ``tp``)."""
    problems = []
    for name, style in plan.styles.items():
        module = root.get_submodule(name)
        if isinstance(style, LocalShardParallel):
            for pname, placement in style.placements.items():
                shape, blocks = module.get_parameter(pname).shape, getattr(placement, "split_factor", 1)
                if isinstance(placement, Shard) and shape[placement.dim] % (tp * blocks):
                    what = f"dim {placement.dim}" + (f" per packed block ({blocks} blocks)" if blocks > 1 else "")
                    problems.append(f"{name}.{pname}[{what}]={shape[placement.dim] // blocks}")
            continue
        if is_projection(module):
            in_features, out_features = projection_features(module)
            if isinstance(style, FusedColwiseParallel):
                dim, what = out_features // style.num_blocks, "out_features per fused block"
                if unequal := _grouped_query_counts(root, name, style):
                    raise HybridConfigError(
                        f"{name!r} is split as {style.num_blocks} equal fused blocks (q|k|v), but its attention has"
                        f" {unequal}: under grouped-query attention q, k and v differ in size and no tensor-parallel"
                        " layout splits each part exactly. Leave the attention replicated: give `tensor_parallel_plan`"
                        " as a dict naming only the MLP layers."
                    )
            elif isinstance(style, ColwiseParallel):
                dim, what = out_features, "out_features"
            elif isinstance(style, RowwiseParallel):
                dim, what = in_features, "in_features"
            else:
                continue
        elif isinstance(module, nn.Embedding) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            rowwise = isinstance(style, RowwiseParallel)
            dim = module.num_embeddings if rowwise else module.embedding_dim
            what = "num_embeddings (vocabulary)" if rowwise else "embedding_dim"
        else:
            continue
        if dim % tp:
            problems.append(f"{name}.{what}={dim}")
    for name in sorted(plan.attention_modules):
        module = root.get_submodule(name)
        for attr in HEAD_COUNT_ATTRIBUTES + SHARDED_WIDTH_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and value % tp:
                problems.append(f"{name}.{attr}={value}")
        problems += [f"{name}.config.{a}={v}" for a, v in config_head_counts(module).items() if v % tp]
    # Hugging Face attention reads head counts from the model config, not from module attributes; a plan that splits
    # no attention (the MLP alone, the fix for a multi-query fused q|k|v) does not divide them
    configs = {id(c): c for m in root.modules() if (c := getattr(m, "config", None)) is not None}.values()
    splits_attention = any(_attention_like(root, name, plan) for name in plan.sharded_region_modules)
    for config in configs:
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and splits_attention and value % tp:
                problems.append(f"config.{attr}={value}")
    if problems:
        raise HybridConfigError(
            f"`tensor_parallel_size={tp}` does not divide {', '.join(problems[:6])}"
            f"{' ...' if len(problems) > 6 else ''}. Choose a tensor_parallel_size that divides the number of heads,"
            " the hidden/FFN sizes and the vocabulary (pad the vocabulary to a multiple of it)."
        )


def _attention_like(root: nn.Module, name: str, plan: TensorParallelPlan) -> bool:
    """Whether the split region ``name`` is an attention module: one with head counts, or named so (its attribute
    or class: transformers' ``self_attn``/``LlamaAttention``, whose counts are in the model config)."""
    kind = type(root.get_submodule(name)).__name__.lower()
    leaf = name.rsplit(".", 1)[-1].lower()
    return name in plan.attention_modules or "attention" in kind or "attn" in leaf or "attention" in leaf


def _grouped_query_counts(root: nn.Module, name: str, style: FusedColwiseParallel) -> str:
    """``"n_head=8, n_query_groups=2"`` where the attention owning a 3-block fused projection has fewer key/value
    heads than query heads (read from the module or its config), else ``""``."""
    if style.num_blocks != 3 or "." not in name:
        return ""
    owner = root.get_submodule(name.rsplit(".", 1)[0])
    counts = {a: getattr(owner, a) for a in HEAD_COUNT_ATTRIBUTES if isinstance(getattr(owner, a, None), int)}
    counts = counts or config_head_counts(owner)
    query = next((a for a in ("n_head", "num_heads", "num_attention_heads") if a in counts), None)
    kv = next((a for a in ("n_kv_head", "n_kv_heads", "num_key_value_heads", "n_query_groups") if a in counts), None)
    if query and kv and counts[query] != counts[kv]:
        return f"{query}={counts[query]}, {kv}={counts[kv]}"
    return ""


def sequence_shard_shape(shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of one tensor-parallel rank's slice of a hidden state ``shape`` under sequence parallel (the sequence,
    dim 1, split ``tp`` ways); a sequence it does not divide is refused. The pipeline sizes its stage boundaries with
    it on every rank before the first micro-batch, so that every rank refuses alike, not only the first stage's.

    Example:
        >>> sequence_shard_shape((4, 16, 32), 2)
        (4, 8, 32)
    """
    if len(shape) < 2 or shape[1] % tp:
        raise HybridConfigError(
            f"`sequence_parallel=True` splits the sequence (dim 1, length {shape[1] if len(shape) > 1 else '?'})"
            f" over {tp} tensor-parallel ranks; use a sequence length divisible by it or turn it off."
        )
    return (shape[0], shape[1] // tp, *shape[2:])


def _sequence_parallel(root: nn.Module, structure: ModelStructure, plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """Megatron-SP: activations between tensor-parallel regions are split along the sequence (dim 1).

    Redistribution goes through DTensor so that autograd gets the matching collective (all-gather forward,
    reduce-scatter backward); only the hook points (first/last block, region inputs given positionally or by keyword,
    which ``PrepareModuleInput`` cannot express together) are ours.
    """

    def to_sequence_shard(x: torch.Tensor) -> torch.Tensor:
        sequence_shard_shape(tuple(x.shape), mesh.size())
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    def to_replicate(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    block_names = structure.block_names()
    root.get_submodule(block_names[0]).register_forward_pre_hook(map_first_input(to_sequence_shard), with_kwargs=True)
    root.get_submodule(block_names[-1]).register_forward_hook(map_output(to_replicate))
    for region in plan.sharded_region_modules:
        root.get_submodule(region).register_forward_pre_hook(map_first_input(to_replicate), with_kwargs=True)
    for block_name in block_names:
        for name, module in root.get_submodule(block_name).named_modules():
            fqn = f"{block_name}.{name}"
            if _is_norm(module) and not any(fqn.startswith(r + ".") for r in plan.sharded_region_modules):
                plan.styles[fqn] = SequenceParallel(use_local_output=True)


def apply_tensor_parallel(
    root: nn.Module, structure: ModelStructure, plan: TensorParallelPlan, mesh: DeviceMesh, *, sequence_parallel: bool
) -> list[tuple[nn.Parameter, str]]:
    """Shard ``root`` in place over the tensor-parallel ``mesh``.

    Returns the parameters left as plain (replicated) tensors, each with the reduction that makes its gradient the
    single-device gradient on every tensor-parallel rank: ``"avg"`` where all ranks computed the full gradient (it
    only removes drift), ``"sum"`` inside a split region, where each rank saw only its share of the heads.

    ``plan`` has passed :func:`validate_tensor_parallel_plan` on the whole model (every rank alike, before a pipeline
    cut restricts it to what this rank holds).

    Example:
        >>> # inside HybridStrategy.setup, after the mesh exists:
        >>> # replicated = apply_tensor_parallel(module, structure, plan, mesh["tensor"], sequence_parallel=False)
    """
    tp = mesh.size()
    if sequence_parallel and plan.inside_split is not None:
        raise HybridConfigError(
            "`sequence_parallel=True` hooks the inputs of each split region's module, and a plan found from the data"
            " flow has no such modules. Give `tensor_parallel_plan` as a dict (the plan printed at set-up), or turn"
            " `sequence_parallel` off."
        )
    if sequence_parallel:
        vocab = (structure.token_embedding_name, structure.output_head_name)
        splits = {n: s for n, s in plan.styles.items() if isinstance(s, (ColwiseParallel, RowwiseParallel))}
        closed_within = [n for n, s in splits.items() if region_role(s) is None and n not in vocab]
        if closed_within:
            raise HybridConfigError(
                f"`sequence_parallel=True` needs every split in the blocks opened column-wise and closed row-wise, but"
                f" {closed_within[:3]} gather or slice within the layer ('colwise_gather_output'/"
                "'rowwise_split_input' styles). Turn `sequence_parallel` off, or give 'colwise'/'rowwise' plans."
            )
        for name, style in list(plan.styles.items()):
            if type(style) in (RowwiseParallel, Conv1DRowwiseParallel) and name != structure.token_embedding_name:
                plan.styles[name] = type(style)(output_layouts=Shard(1))
        _sequence_parallel(root, structure, plan, mesh)
    parallelize_module(root, mesh, plan.styles)
    if plan.vocab_parallel_head in plan.styles:  # held here (another pipeline stage holds a stand-in instead)
        # its logits reach the step split, as a tensor that behaves as the whole logits (tensor_parallel/vocab.py)
        root.get_submodule(plan.vocab_parallel_head).register_forward_hook(split_logits_hook)
    for name in plan.attention_modules:
        module = root.get_submodule(name)
        for attr in HEAD_COUNT_ATTRIBUTES + SHARDED_WIDTH_ATTRIBUTES:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, getattr(module, attr) // tp)
        if counts := config_head_counts(module):
            # a copy per attention module: the config object is shared (the model's, the hyper-parameters a
            # checkpoint saves), and only this module computes on a rank's share of the heads
            module.config = copy.copy(module.config)
            for attr, value in counts.items():
                setattr(module.config, attr, value // tp)
    _retie(root, structure)

    replicated = []
    for name, param in root.named_parameters():
        if isinstance(param, DTensor):
            continue
        owner = name.rsplit(".", 1)[0]
        if plan.inside_split is not None:  # found by data flow: exactly the modules between the splits
            inside = owner in plan.inside_split or owner in plan.gradient_sum_modules
        else:
            summed = plan.sharded_region_modules | plan.gradient_sum_modules
            inside = owner not in plan.full_width_modules and any(
                owner == r or owner.startswith(r + ".") for r in summed
            )
        replicated.append((param, "sum" if inside else "avg"))
    return replicated


def _retie(root: nn.Module, structure: ModelStructure) -> None:
    """Parallelizing replaces each parameter by a new DTensor parameter, which unties shared weights; tie them again."""
    # by the parameters this rank holds: a pipeline stub keeps the other side's attributes readable (not held)
    held = dict(root.named_parameters(remove_duplicate=False))
    for first, second in structure.tied_parameters:
        if first not in held or second not in held:
            continue  # the two sides are on different pipeline stages; their gradients are summed across stages
        keep, other = held[first], held[second]
        if keep is other:
            continue
        placements_a = keep.placements if isinstance(keep, DTensor) else None
        placements_b = other.placements if isinstance(other, DTensor) else None
        if placements_a != placements_b:
            raise HybridConfigError(
                f"{first!r} and {second!r} are one tied tensor, but the tensor-parallel plan splits them differently"
                f" ({placements_a} vs {placements_b}). Split both the same way (vocab-parallel embedding with a"
                " column-wise head), or untie them."
            )
        module_name, _, attr = second.rpartition(".")
        setattr(root.get_submodule(module_name) if module_name else root, attr, keep)
