"""Tensor-parallel plans: found automatically, translated from Hugging Face, or given as a dict of name patterns.

A plan is a dict ``{fully qualified module name: ParallelStyle}`` for ``torch.distributed.tensor.parallel``. The
styles are torch's own (``ColwiseParallel``/``RowwiseParallel``...); the one style torch lacks, a column-wise split of
a *fused* projection (q|k|v or gate|up stored in one Linear), is defined here.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from types import MethodType
from typing import Any, Optional, Union

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.structure import ModelStructure

__all__ = ["FusedColwiseParallel", "TensorParallelPlan", "build_tensor_parallel_plan"]

# Leaf names of Linear layers in common transformer families (nanoGPT, Llama/Mistral/Qwen, GPT-J/NeoX, Falcon, BERT).
COLWISE_NAMES = {
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
    "c_fc", "fc1", "fc_in", "up_proj", "gate_proj", "w1", "w3", "dense_h_to_4h",
}  # fmt: skip
ROWWISE_NAMES = {
    "o_proj",
    "out_proj",
    "c_proj",
    "dense",
    "wo",
    "proj",
    "fc2",
    "fc_out",
    "down_proj",
    "w2",
    "dense_4h_to_h",
}
# Fused projections: how many equal column blocks the output holds (q|k|v -> 3, gate|up -> 2).
FUSED_NAMES = {"c_attn": 3, "qkv": 3, "qkv_proj": 3, "Wqkv": 3, "in_proj": 3, "gate_up_proj": 2, "w13": 2}
# Attributes that count attention heads: divided by the tensor-parallel size on the attention module, because after a
# column-wise split each rank computes only its share of the heads.
HEAD_COUNT_ATTRIBUTES = ("n_head", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads")

PlanSpec = Union[str, dict[str, Union[str, ParallelStyle]]]


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

    def _placement(self, dim: int) -> Any:
        # torch has no public placement for "split each of k blocks"; _StridedShard is the placement FSDP2+TP uses
        # for exactly this layout, and checkpoints see the original, unpermuted weight through a block view
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(dim, split_factor=self.num_blocks)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in module.named_parameters():
            dist_param = nn.Parameter(distribute_tensor(param, device_mesh, [self._placement(0)]), param.requires_grad)
            module.register_parameter(pname, dist_param)

    def _prepare_output(self, mod: nn.Module, outputs: Tensor, device_mesh: Any) -> Any:
        # the local output is already [q_r | k_r | v_r]: no redistribution
        if self.use_local_output:
            return outputs
        return DTensor.from_local(outputs, device_mesh, [self._placement(outputs.dim() - 1)], run_check=False)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise HybridConfigError(
                f"FusedColwiseParallel (the 'fused_colwise_<k>' style) splits nn.Linear layers only, not"
                f" {type(module).__name__}. Give that module another style in `tensor_parallel_plan`."
            )
        input_fn = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        distribute_module(module, device_mesh, self._partition_linear_fn, input_fn, self._prepare_output)
        module.forward = MethodType(_local_linear_forward, module)
        return module


def _local_linear_forward(self: nn.Linear, input: Any) -> Tensor:
    """``nn.Linear.forward`` of a fused column-parallel layer, on local tensors: ``x @ W_r^T + b_r`` is this rank's
    ``[q_r | k_r | v_r]``. The weight's and bias's gradients come back laid out like them; the input's gradient here
    is this rank's heads' share only, so it is marked ``Partial`` and the input hook's DTensor sums it over the
    tensor-parallel ranks in backward (the all-reduce a DTensor matmul would have done)."""
    if isinstance(input, DTensor):
        input = input.to_local(grad_placements=[Partial()] * input.device_mesh.ndim)
    bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
    weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
    return F.linear(input, weight, bias)


class TensorParallelPlan:
    """A resolved plan: the styles per module, the attention modules whose head counts shrink, and the modules that
    sit between a column- and a row-wise split (their own replicated parameters see only a shard of the heads)."""

    def __init__(self) -> None:
        self.styles: dict[str, ParallelStyle] = {}
        self.attention_modules: set[str] = set()
        self.sharded_region_modules: set[str] = set()
        self.vocab_parallel_head: Optional[str] = None

    def restrict_to(self, root: nn.Module) -> None:
        """Keep only modules this rank still holds (pipeline stages replace the others by parameter-less stubs)."""

        def held(name: str) -> bool:
            try:
                return any(True for _ in root.get_submodule(name).parameters())
            except AttributeError:
                return False

        self.styles = {n: s for n, s in self.styles.items() if held(n)}
        self.attention_modules = {n for n in self.attention_modules if held(n)}
        self.sharded_region_modules = {n for n in self.sharded_region_modules if held(n)}
        if self.vocab_parallel_head is not None and not held(self.vocab_parallel_head):
            # the head is on another stage; the loss still runs there under loss_parallel, not here
            pass

    def describe(self) -> str:
        lines = [f"  {name}: {type(style).__name__}" for name, style in self.styles.items()]
        return "\n".join(lines)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _vocab_styles(plan: TensorParallelPlan, structure: ModelStructure, vocab_parallel_loss: bool) -> None:
    if structure.token_embedding_name is not None:
        # vocab-parallel embedding: each rank looks up its vocabulary range, partial results are summed
        plan.styles[structure.token_embedding_name] = RowwiseParallel(input_layouts=Replicate())
    if structure.output_head_name is not None:
        if vocab_parallel_loss:
            # keep logits sharded over the vocabulary; the loss runs under torch's loss_parallel()
            plan.styles[structure.output_head_name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            plan.vocab_parallel_head = structure.output_head_name
        else:
            plan.styles[structure.output_head_name] = ColwiseParallel(output_layouts=Replicate())


def _auto_plan(root: nn.Module, structure: ModelStructure, vocab_parallel_loss: bool) -> TensorParallelPlan:
    plan = TensorParallelPlan()
    blocks = root.get_submodule(structure.blocks_name)
    for index, block in enumerate(blocks):
        prefix = f"{structure.blocks_name}.{index}"
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf, fqn = name.rsplit(".", 1)[-1], f"{prefix}.{name}"
            if leaf in FUSED_NAMES:
                plan.styles[fqn] = FusedColwiseParallel(num_blocks=FUSED_NAMES[leaf])
            elif leaf in COLWISE_NAMES:
                plan.styles[fqn] = ColwiseParallel()
            elif leaf in ROWWISE_NAMES:
                plan.styles[fqn] = RowwiseParallel()
    _finish_plan(plan, root, structure)
    _vocab_styles(plan, structure, vocab_parallel_loss)
    if not plan.styles:
        raise HybridConfigError(
            "`tensor_parallel_plan='auto'` found no Linear layer it knows how to split in the blocks of"
            f" {structure.blocks_name!r}. Give a plan: `tensor_parallel_plan={{'{structure.blocks_name}.*.attn.q': "
            "'colwise', ...}`, or parallelize in `configure_model` with `self.device_mesh['tensor']`."
        )
    return plan


def _finish_plan(plan: TensorParallelPlan, root: nn.Module, structure: ModelStructure) -> None:
    """Find attention modules and the sharded regions; check that every split region is closed by a row-wise split."""
    regions: dict[str, set[str]] = {}
    for name, style in plan.styles.items():
        if structure.blocks_name is not None:
            inside_blocks = name.startswith(structure.blocks_name + ".")
        else:  # a module without a block list (a dict plan): any layer but the embedding and the head
            inside_blocks = name not in (structure.token_embedding_name, structure.output_head_name)
        if not inside_blocks or not isinstance(root.get_submodule(name), nn.Linear):
            continue  # embeddings and the head are split on their own: they open no region
        kind = "row" if isinstance(style, RowwiseParallel) else "col" if isinstance(style, ColwiseParallel) else None
        if kind:
            regions.setdefault(_parent(name), set()).add(kind)
    for parent, kinds in regions.items():
        if kinds != {"col", "row"}:
            missing = "row-wise (output) projection" if "row" not in kinds else "column-wise (input) projection"
            raise HybridConfigError(
                f"The tensor-parallel plan splits layers of {parent!r} but has no {missing} there, so its output"
                " would stay sharded. Add the missing layer to `tensor_parallel_plan` (as 'rowwise' or 'colwise')."
            )
        plan.sharded_region_modules.add(parent)
        module = root.get_submodule(parent)
        if any(isinstance(getattr(module, attr, None), int) for attr in HEAD_COUNT_ATTRIBUTES):
            plan.attention_modules.add(parent)


_STRING_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
}


def _style_from_string(style: str, name: str) -> ParallelStyle:
    if style in ("embedding_rowwise", "vocab_parallel_embedding"):
        return RowwiseParallel(input_layouts=Replicate())
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style.startswith("fused_colwise_"):
        return FusedColwiseParallel(num_blocks=int(style.rsplit("_", 1)[1]))
    if style in _STRING_STYLES:
        return _STRING_STYLES[style]()
    known = sorted([*_STRING_STYLES, "embedding_rowwise", "colwise_rep", "colwise_gather_output", "fused_colwise_<k>"])
    raise HybridConfigError(
        f"`tensor_parallel_plan` gives {name!r} the style {style!r}, which is not one of {known}. Use one of these or"
        " a torch ParallelStyle object."
    )


def _pattern_plan(
    root: nn.Module,
    structure: ModelStructure,
    patterns: dict[str, Union[str, ParallelStyle]],
    vocab_parallel_loss: bool,
) -> TensorParallelPlan:
    plan = TensorParallelPlan()
    names = [n for n, _ in root.named_modules() if n]
    for pattern, style in patterns.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise HybridConfigError(
                f"`tensor_parallel_plan` pattern {pattern!r} matches no module of {type(root).__name__}. Module"
                f" names look like {names[:6]}; fix the pattern (fnmatch syntax, '*' for a layer index)."
            )
        for name in matched:
            if isinstance(style, ParallelStyle):
                plan.styles[name] = style
            elif name in (structure.output_head_name,) and style in ("colwise_rep", "colwise_gather_output"):
                continue  # the vocabulary head is handled below, keeping logits sharded for the loss
            else:
                plan.styles[name] = _style_from_string(style, name)
    _finish_plan(plan, root, structure)
    head_given = structure.output_head_name in plan.styles
    emb_given = structure.token_embedding_name in plan.styles
    vocab = TensorParallelPlan()
    _vocab_styles(vocab, structure, vocab_parallel_loss)
    for name, style in vocab.styles.items():
        if (name == structure.output_head_name and not head_given) or (
            name == structure.token_embedding_name and not emb_given
        ):
            plan.styles[name] = style
            if name == structure.output_head_name:
                plan.vocab_parallel_head = vocab.vocab_parallel_head
    return plan


def _hugging_face_plan(root: nn.Module, structure: ModelStructure) -> Optional[dict[str, str]]:
    """The plan a transformers model declares (``model._tp_plan``), with names made relative to ``root``."""
    network = root.get_submodule(structure.network_name) if structure.network_name else root
    declared = getattr(network, "_tp_plan", None)
    if not declared:
        return None
    prefix = f"{structure.network_name}." if structure.network_name else ""
    return {prefix + pattern: style for pattern, style in declared.items()}


def build_tensor_parallel_plan(
    root: nn.Module,
    structure: ModelStructure,
    plan: PlanSpec = "auto",
    *,
    vocab_parallel_loss: bool = True,
) -> TensorParallelPlan:
    """Resolve ``tensor_parallel_plan`` (``"auto"`` or a dict of patterns) for ``root``.

    Example:
        >>> from torch import nn
        >>> from lightning_hybrid.structure import find_model_structure
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.c_fc, self.c_proj = nn.Linear(8, 32), nn.Linear(32, 8)
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([Block(), Block()]))
        >>> sorted(build_tensor_parallel_plan(net, find_model_structure(net)).styles)
        ['1.0.c_fc', '1.0.c_proj', '1.1.c_fc', '1.1.c_proj']
    """
    if plan == "auto":
        hf_plan = _hugging_face_plan(root, structure)
        if hf_plan is not None:
            return _pattern_plan(root, structure, hf_plan, vocab_parallel_loss)
        return _auto_plan(root, structure, vocab_parallel_loss)
    if isinstance(plan, dict):
        return _pattern_plan(root, structure, plan, vocab_parallel_loss)
    raise HybridConfigError(
        f"`tensor_parallel_plan` must be 'auto' or a dict {{module-name pattern: style}}, got {plan!r}. To write the"
        " plan in code, call `parallelize_module(..., self.device_mesh['tensor'], ...)` in `configure_model`."
    )
