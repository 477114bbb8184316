"""Tensor-parallel plans: found automatically, translated from Hugging Face, or given as a dict of name patterns.

A plan is a dict ``{fully qualified module name: ParallelStyle}`` for ``torch.distributed.tensor.parallel``. The
styles are torch's own (``ColwiseParallel``/``RowwiseParallel``...) where torch has one; the few it lacks, and the
translation of transformers' style names, are in :mod:`lightning_hybrid.tensor_parallel.styles`.
"""

from __future__ import annotations

import fnmatch
from typing import Optional, Union

from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.structure import ModelStructure
from lightning_hybrid.tensor_parallel.discover import check_block_plan, discover_block_plan
from lightning_hybrid.tensor_parallel.styles import (
    FusedColwiseParallel,
    GradientSum,
    RopeGradientSumParallel,
    is_projection,
    parameter_placement,
    projection_features,
    region_role,
    split_style,
    style_from_name,
)

__all__ = ["TensorParallelPlan", "build_tensor_parallel_plan"]

# Leaf names of Linear layers in common transformer families (nanoGPT, Llama/Mistral/Qwen, GPT-J/NeoX, Falcon, BERT).
COLWISE_NAMES = {
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
    "c_fc", "fc1", "fc_in", "up_proj", "gate_proj", "w1", "w3", "dense_h_to_4h", "fc", "fc_1", "fc_2",
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
HEAD_COUNT_ATTRIBUTES = (
    "n_head", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads", "n_query_groups",
)  # fmt: skip
# Attributes of an attention module holding the width of its sharded activations (GPT-2's ``split_size``, the width
# of each of q|k|v its forward splits the fused ``c_attn`` output by; BERT-style ``all_head_size``, heads x head
# size): divided along with the head counts. Not ``embed_dim``/``hidden_size``: those are the replicated width too.
SHARDED_WIDTH_ATTRIBUTES = ("split_size", "all_head_size")


def config_head_counts(module: nn.Module) -> dict[str, int]:
    """Head counts the module reads from its own ``config`` object (litgpt's ``self.config.n_head``). Hugging Face
    attention reshapes with ``-1`` and never needs them changed, so its configs are left out."""
    config = getattr(module, "config", None)
    if config is None or type(config).__module__.startswith("transformers"):
        return {}
    return {a: v for a in HEAD_COUNT_ATTRIBUTES if isinstance(v := getattr(config, a, None), int)}


PlanSpec = Union[str, dict[str, Union[str, ParallelStyle]]]


class TensorParallelPlan:
    """A resolved plan: the styles per module, the attention modules whose head counts shrink, and the modules that
    sit between a column- and a row-wise split (their own replicated parameters see only a shard of the heads)."""

    def __init__(self) -> None:
        self.styles: dict[str, ParallelStyle] = {}
        self.attention_modules: set[str] = set()
        self.sharded_region_modules: set[str] = set()
        # modules whose replicated parameters see one rank's share of a split: gradients summed, not averaged
        self.gradient_sum_modules: set[str] = set()
        # modules inside a region's module that compute on the full hidden state, not on a split (OPT's layer norms
        # sit next to fc1/fc2 in the decoder layer): their gradients are whole on every rank, averaged, not summed
        self.full_width_modules: set[str] = set()
        # a plan found by data flow knows exactly which modules compute between its splits (``None``: by names, every
        # module under a split region's parent does)
        self.inside_split: Optional[set[str]] = None
        # where the data flow was followed or checked: each column-wise split -> the row-wise split that reads its
        # output (which may sit in a sibling module, BERT's ``attention.output.dense`` for ``attention.self.query``)
        self.closed_by: dict[str, str] = {}
        self.vocab_parallel_head: Optional[str] = None

    def restrict_to(self, root: nn.Module) -> None:
        """Keep only modules this rank still holds (pipeline stages replace the others by parameter-less stubs)."""

        # by the stage's own parameter names: a stub keeps the attributes of what it stands for readable (a meta copy,
        # tied weights' real tensors), so reaching a module by name does not mean this rank holds it
        owned = {n for n, _ in root.named_parameters(remove_duplicate=False)}

        def held(name: str) -> bool:
            return any(n.startswith(name + ".") for n in owned)

        self.styles = {n: s for n, s in self.styles.items() if held(n)}
        self.attention_modules = {n for n in self.attention_modules if held(n)}
        self.sharded_region_modules = {n for n in self.sharded_region_modules if held(n)}
        self.gradient_sum_modules = {n for n in self.gradient_sum_modules if held(n)}
        self.full_width_modules = {n for n in self.full_width_modules if held(n)}
        if self.inside_split is not None:
            self.inside_split = {n for n in self.inside_split if held(n)}
        # vocab_parallel_head stays even when another stage holds the head: the loss runs there, under loss_parallel

    def without(self, names: list[str]) -> None:
        """Drop the entries of the modules ``names`` and everything inside them: under expert parallel, the experts
        modules are split over expert ranks instead, and each tensor-parallel rank holds its expert shard whole."""

        def kept(name: str) -> bool:
            return not any(name == n or name.startswith(n + ".") for n in names)

        self.styles = {n: s for n, s in self.styles.items() if kept(n)}
        for attribute in ("attention_modules", "sharded_region_modules", "gradient_sum_modules", "full_width_modules"):
            setattr(self, attribute, {n for n in getattr(self, attribute) if kept(n)})
        if self.inside_split is not None:
            self.inside_split = {n for n in self.inside_split if kept(n)}

    def describe(self) -> str:
        lines = [f"  {name}: {type(style).__name__}" for name, style in self.styles.items()]
        return "\n".join(lines)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _sibling(a: str, b: str) -> bool:
    return a != b and _parent(a) == _parent(b)


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
    """The names table first (fast, no forward); where it finds nothing or leaves a region open, the data flow of
    one forward of the module's ``example_input_array`` (:func:`discover_block_plan`)."""
    plan = TensorParallelPlan()
    blocks = root.get_submodule(structure.blocks_name)
    for index, block in enumerate(blocks):
        prefix = f"{structure.blocks_name}.{index}"
        for name, module in block.named_modules():
            if not is_projection(module):  # nn.Linear, or transformers' Conv1D (GPT-2's, weight transposed)
                continue
            leaf, fqn = name.rsplit(".", 1)[-1], f"{prefix}.{name}"
            if leaf in FUSED_NAMES:
                plan.styles[fqn] = FusedColwiseParallel(num_blocks=FUSED_NAMES[leaf])
            elif leaf in COLWISE_NAMES:
                plan.styles[fqn] = split_style("colwise", module)
            elif leaf in ROWWISE_NAMES:
                plan.styles[fqn] = split_style("rowwise", module)
    names_error: Optional[HybridConfigError] = None
    try:
        _finish_plan(plan, root, structure)
    except HybridConfigError as error:
        names_error = error
    if names_error is not None or not plan.styles:
        plan = _data_flow_plan(root, structure, names_error)
    elif not plan.closed_by:  # not yet checked by data flow (_finish_plan does where a region is open by names)
        _check_by_data_flow(root, structure, plan)
    _vocab_styles(plan, structure, vocab_parallel_loss)
    return plan


def _check_by_data_flow(root: nn.Module, structure: ModelStructure, plan: TensorParallelPlan) -> bool:
    """Check a plan found by layer names (or given as a dict) against the data flow of one forward of the module's
    ``example_input_array``, where it has one, and record in ``plan.closed_by`` which row-wise split reads which
    column-wise ones: the names do not tell a fused projection's parts (unequal q|k|v under grouped-query attention,
    a per-head interleaved qkv), whether a norm computes over the sharded features, nor that a split opened in one
    module closes in a sibling (BERT). Returns whether the check ran."""
    example = getattr(root, "example_input_array", None)
    if example is None or structure.blocks_name is None:
        return False
    blocks = structure.block_names()
    first = blocks[0]
    styles: dict[str, str] = {}
    for name, style in plan.styles.items():
        role = region_role(style)
        if not name.startswith(first + ".") or role is None:
            continue
        fused = isinstance(style, FusedColwiseParallel)
        styles[name[len(first) + 1 :]] = f"fused_colwise_{style.num_blocks}" if fused else f"{role}wise"
    if not styles:
        return False
    try:
        regions = check_block_plan(root, first, example, styles)
    except HybridConfigError:
        raise
    except Exception as error:  # the example input does not run through the model: the plan stands unchecked
        rank_zero_info(f"lightning-hybrid: the tensor-parallel plan by names is not checked by data flow: {error}")
        return False
    for block in blocks:  # every block laid out like the first (the names table and a '*' pattern give the same)
        for closer, openers in regions.items():
            if f"{block}.{closer}" in plan.styles:
                plan.closed_by |= {
                    f"{block}.{o}": f"{block}.{closer}" for o in openers if f"{block}.{o}" in plan.styles
                }
    return True


def _example_plan(root: nn.Module, structure: ModelStructure) -> str:
    """A dict plan for the error messages, in the model's own layer names: the column-wise/row-wise pairs that the
    names table finds inside one module of the first block (an MLP's, where the attention's fused projection goes by
    a name the table does not know: GPT-NeoX/Falcon/BLOOM's ``query_key_value``), which split alone leave the rest
    replicated; else the block's projections, whose styles the user picks."""
    first = structure.block_names()[0]
    names = [n for n, m in root.get_submodule(first).named_modules() if n and is_projection(m)]
    leaf = {n: n.rsplit(".", 1)[-1] for n in names}
    pairs: dict[str, str] = {}
    for closer in (n for n in names if leaf[n] in ROWWISE_NAMES):
        openers = [n for n in names if leaf[n] in COLWISE_NAMES and _parent(n) == _parent(closer)]
        if openers:
            pairs.update({n: "colwise" for n in openers} | {closer: "rowwise"})
    if not pairs:
        pairs = {n: "colwise' or 'rowwise" for n in names[:4]}
    shown = ", ".join(f"'{structure.blocks_name}.*.{n}': '{style}'" for n, style in pairs.items())
    return f"`tensor_parallel_plan={{{shown}}}`"


def _data_flow_plan(
    root: nn.Module, structure: ModelStructure, names_error: Optional[HybridConfigError]
) -> TensorParallelPlan:
    example = getattr(root, "example_input_array", None)
    if example is None:
        why = f" (by names: {names_error})" if names_error else ""
        raise HybridConfigError(
            "`tensor_parallel_plan='auto'` could not tell the split layers of the blocks of"
            f" {structure.blocks_name!r} from their names{why}, and the module has no `example_input_array` to follow"
            " the data flow of one forward. Set `self.example_input_array` in the LightningModule, or give a plan in"
            f" this model's layer names, e.g. {_example_plan(root, structure)} (the layers not named stay"
            " replicated)."
        )
    first, *others = structure.block_names()
    block_plan, inside_split, regions = discover_block_plan(root, first, example)
    if not block_plan:
        raise HybridConfigError(
            f"`tensor_parallel_plan='auto'` found no pair of projections to split in {first!r} (by names or by data"
            f" flow). Give a plan in this model's layer names, e.g. {_example_plan(root, structure)}."
        )
    layout = _module_kinds(root.get_submodule(first))
    plan = TensorParallelPlan()
    plan.inside_split = set()
    for block in [first, *others]:
        if _module_kinds(root.get_submodule(block)) != layout:
            raise HybridConfigError(
                f"`tensor_parallel_plan='auto'` followed the data flow of {first!r}, but {block!r} is built"
                " differently. Give `tensor_parallel_plan` as a dict for each kind of block."
            )
        for leaf, style in block_plan.items():
            name = f"{block}.{leaf}"
            plan.styles[name] = style_from_name(style, name, root.get_submodule(name))
        plan.inside_split |= {f"{block}.{leaf}" for leaf in inside_split}
        plan.closed_by |= {f"{block}.{o}": f"{block}.{closer}" for closer, openers in regions.items() for o in openers}
    _finish_plan(plan, root, structure)
    rank_zero_info(f"lightning-hybrid: tensor-parallel plan of {first!r} found from its data flow: {block_plan}")
    return plan


def _module_kinds(block: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(module).__name__) for name, module in block.named_modules()]


def _finish_plan(plan: TensorParallelPlan, root: nn.Module, structure: ModelStructure) -> None:
    """Find attention modules and the sharded regions; check that every split region is closed by a row-wise split:
    in the module that opens it, or, where the data flow showed it (``plan.closed_by``), in a sibling module."""
    regions: dict[str, set[str]] = {}
    members: dict[str, list[str]] = {}
    for name, style in plan.styles.items():
        if structure.blocks_name is not None:
            inside_blocks = name.startswith(structure.blocks_name + ".")
        else:  # a module without a block list (a dict plan): any layer but the embedding and the head
            inside_blocks = name not in (structure.token_embedding_name, structure.output_head_name)
        if not inside_blocks or not is_projection(root.get_submodule(name)):
            continue  # embeddings and the head are split on their own: they open no region
        kind = region_role(style)
        if kind:
            regions.setdefault(_parent(name), set()).add(kind)
            members.setdefault(_parent(name), []).append(name)
    open_regions = any(kinds != {"col", "row"} for kinds in regions.values())
    if open_regions and not plan.closed_by and structure.blocks_name is not None:
        # a split that the module opening it does not close may close in a sibling module: the data flow tells
        _check_by_data_flow(root, structure, plan)

    def closed_in_sibling(opener: str) -> bool:
        closer = plan.closed_by.get(opener)
        return closer is not None and _parent(closer) != _parent(opener) and _sibling(_parent(closer), _parent(opener))

    closes = set(plan.closed_by.values())
    for parent, kinds in regions.items():
        if kinds == {"row"} and all(n in closes for n in members[parent]):
            continue  # closes splits opened in a sibling module; its own other modules compute on whole tensors
        if kinds == {"col"} and all(closed_in_sibling(n) for n in members[parent]):
            pass  # opened here, closed in a sibling module (the data flow checked that nothing else reads the shards)
        elif kinds != {"col", "row"}:
            missing = "row-wise (output) projection" if "row" not in kinds else "column-wise (input) projection"
            raise HybridConfigError(
                f"The tensor-parallel plan splits layers of {parent!r} but has no {missing} there, so its output"
                " would stay sharded. Add the missing layer to `tensor_parallel_plan` (as 'rowwise' or 'colwise')."
            )
        plan.sharded_region_modules.add(parent)
        module = root.get_submodule(parent)
        plan.full_width_modules |= _full_width_modules(plan, module, parent)
        if any(isinstance(getattr(module, attr, None), int) for attr in HEAD_COUNT_ATTRIBUTES) or config_head_counts(
            module
        ):
            plan.attention_modules.add(parent)


def _full_width_modules(plan: TensorParallelPlan, region: nn.Module, region_name: str) -> set[str]:
    """Modules under a split region's module whose own parameters are all vectors of the width its column-wise
    layers read (a layer norm before ``fc1``): a norm of that width cannot run on a rank's shard of the split, so it
    runs on the replicated hidden state and each rank computes its whole gradient. Per-head norms (Qwen3's q/k
    norms, of the head width) stay inside the split. So do replicated projections whose output is that width, and
    multi-head latent attention's ``kv_a_proj_with_mqa`` (:class:`RopeGradientSumParallel`)."""
    prefix = f"{region_name}." if region_name else ""
    widths = {
        getattr(region.get_submodule(n[len(prefix) :]), "in_features", None)
        for n, style in plan.styles.items()
        if _parent(n) == region_name and region_role(style) == "col"
    }
    found = set()
    for name, module in region.named_modules():
        own = list(module.parameters(recurse=False))
        full = prefix + name
        if isinstance(plan.styles.get(full), RopeGradientSumParallel):
            found.add(full)  # its style makes the one partial part of its gradient whole
            continue
        if not name or not own or full in plan.styles or full in plan.gradient_sum_modules:
            continue
        if all(p.dim() == 1 and p.numel() in widths for p in own):
            found.add(full)
        elif is_projection(module) and _low_rank_into(projection_features(module), widths):
            # a replicated low-rank projection into a column-wise one (DeepSeek's q_a_proj before q_b_proj): the
            # split layer sums its input's gradient over the tensor ranks, so this layer's gradient is whole
            found.add(full)
    return found


def _low_rank_into(features: tuple[int, int], widths: set[Optional[int]]) -> bool:
    """A projection that narrows its input to the width a column-wise layer reads (``in -> rank``, ``rank < in``)."""
    width_in, width_out = features
    return width_out in widths and width_out < width_in


def _pattern_plan(
    root: nn.Module,
    structure: ModelStructure,
    patterns: dict[str, Union[str, ParallelStyle]],
    vocab_parallel_loss: bool,
    *,
    declared: bool = False,
) -> TensorParallelPlan:
    """``patterns`` resolved on ``root``; ``declared``: the model's own plan (``_tp_plan``), whose patterns for layers
    this variant lacks are skipped; a user's pattern that matches nothing is refused (a typo)."""
    plan = TensorParallelPlan()
    modules = {n: m for n, m in root.named_modules() if n}
    parameters = dict(root.named_parameters())
    module_styles: dict[str, Union[str, ParallelStyle]] = {}
    placements: dict[str, dict[str, Placement]] = {}  # module -> its own parameters' placements (parameter entries)
    for pattern, style in patterns.items():
        matched = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        by_name = isinstance(style, str)  # a parameter takes a style name; a ParallelStyle object goes on a module
        matched_parameters = [n for n in parameters if by_name and fnmatch.fnmatchcase(n, pattern)]
        if not matched and not matched_parameters:
            if declared:  # a model's own plan names layers of every variant (Qwen2-MoE's dense MLPs), as HF skips
                continue
            raise HybridConfigError(
                f"`tensor_parallel_plan` pattern {pattern!r} matches no module of {type(root).__name__}. Module"
                f" names look like {list(modules)[:6]}; fix the pattern (fnmatch syntax, '*' for a layer index)."
            )
        for name in matched:
            if name == structure.output_head_name and style in ("colwise_rep", "colwise_gather_output"):
                continue  # the vocabulary head is handled below, keeping logits sharded for the loss
            module_styles[name] = style
        for name in matched_parameters:
            placement = parameter_placement(style, name, parameters[name])
            if placement is not None:
                owner, _, attr = name.rpartition(".")
                placements.setdefault(owner, {})[attr] = placement
    for owner in placements:
        if owner not in module_styles:
            raise HybridConfigError(
                f"`tensor_parallel_plan` shards parameters of {owner!r} ({', '.join(placements[owner])}) but gives the"
                f" module no style: add {{{owner!r}: 'moe_tp_experts'}} (experts whose partial outputs are summed) or"
                " 'local_params' to the plan."
            )
    for name, style in module_styles.items():
        if isinstance(style, ParallelStyle):
            plan.styles[name] = style
            continue
        rope_dim = _rope_dim(modules, name) if style == "mla_kv_a_proj" else None
        translated = style_from_name(style, name, modules[name], placements.get(name), rope_dim)
        if isinstance(translated, GradientSum):
            plan.gradient_sum_modules.add(name)
        elif translated is not None:
            plan.styles[name] = translated
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


def _rope_dim(modules: dict[str, nn.Module], name: str) -> Optional[int]:
    """The rotary key features of the attention holding ``name`` (multi-head latent attention's
    ``qk_rope_head_dim``, an attribute of transformers' attention modules and of their configs), or None."""
    parent = modules.get(name.rpartition(".")[0])
    for holder in (parent, getattr(parent, "config", None)):
        value = getattr(holder, "qk_rope_head_dim", None)
        if isinstance(value, int):
            return value
    return None


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
            return _pattern_plan(root, structure, hf_plan, vocab_parallel_loss, declared=True)
        return _auto_plan(root, structure, vocab_parallel_loss)
    if isinstance(plan, dict):
        return _pattern_plan(root, structure, plan, vocab_parallel_loss)
    raise HybridConfigError(
        f"`tensor_parallel_plan` must be 'auto' or a dict {{module-name pattern: style}}, got {plan!r}. To write the"
        " plan in code, call `parallelize_module(..., self.device_mesh['tensor'], ...)` in `configure_model`."
    )
