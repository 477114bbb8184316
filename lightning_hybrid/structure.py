"""Finding the shape of a transformer inside a LightningModule: its repeated block list, token embedding and head.

Tensor parallel (which layers to shard), ZeRO-3 (what to wrap), activation checkpointing (what to recompute) and the
pipeline (where to cut) all need the same answer, so it is found once, here, and never per feature.

Data parallel and ZeRO need no block list: a module without one (a CNN, an MLP) has a structure with
``blocks_name=None``, and only the features that cut or recompute per block ask for it (``needed_by``).

A parameter's name is read the same way everywhere too (:func:`state_dict_name`: without the wrappers torch inserts),
by the pipeline's shared parameters, its verification and the checkpoints alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from torch import nn

from lightning_hybrid._torch_compat import WRAPPER_PREFIXES
from lightning_hybrid.config import HybridConfigError

__all__ = ["ModelStructure", "block_list_needed_by", "find_model_structure", "other_block_lists", "state_dict_name"]


@dataclass
class ModelStructure:
    """Where the parts of a transformer live, as fully qualified names relative to the LightningModule."""

    network_name: str
    """The module that owns the block list and is called by ``training_step`` ("" is the LightningModule itself)."""
    blocks_name: Optional[str]
    """The repeated ``nn.ModuleList``/``nn.Sequential`` of transformer blocks (None: the module has none)."""
    num_blocks: int
    token_embedding_name: Optional[str] = None
    output_head_name: Optional[str] = None
    tied_parameters: list[tuple[str, str]] = field(default_factory=list)
    """Pairs of parameter names that are one tensor (e.g. input embedding and output head)."""

    def block_names(self) -> list[str]:
        if self.blocks_name is None:
            return []
        return [f"{self.blocks_name}.{i}" for i in range(self.num_blocks)]

    def fully_shard_roots(self, root: nn.Module) -> list[str]:
        """The modules ZeRO-3 wraps with FSDP2 after the blocks, innermost first: FSDP2 takes the parameters that
        no already wrapped submodule holds, so a module must come after the modules inside it.

        They are the network that owns the block list and every other child of ``root`` with parameters (without
        a block list: every child with parameters); a container without ``forward`` (``nn.ModuleList``/
        ``nn.ModuleDict``), which FSDP2 cannot wrap, gives its children instead. ``root`` itself is never one:
        ``training_step`` may call its children without calling its ``forward``, and an FSDP2 unit whose forward
        never runs never gathers its parameters. Parameters held directly by ``root`` therefore stay replicated over
        the data-parallel ranks, as do parameters outside every unit (``apply_fully_shard`` reports them).
        """
        units: list[str] = []

        def add(name: str, module: nn.Module) -> None:
            if _num_params(module) == 0 or (self.blocks_name is not None and name == self.blocks_name):
                return  # nothing to shard, or the block list itself (its blocks are units already)
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                for child_name, child in module.named_children():
                    add(f"{name}.{child_name}", child)
            else:
                units.append(name)

        for name, child in root.named_children():
            if name != self.network_name:
                add(name, child)
        if self.network_name:
            units.append(self.network_name)
        return units


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_list_needed_by(
    *,
    pipeline_parallel_size: int = 1,
    activation_checkpointing: Union[bool, str, None] = False,
    tensor_parallel_auto_plan: bool = False,
    sequence_parallel: bool = False,
) -> list[str]:
    """The settings of a layout that need the repeated block list, each with the reason (empty: none do).

    Example:
        >>> block_list_needed_by(pipeline_parallel_size=2)
        ['`pipeline_parallel_size=2` (the pipeline stages are cut between blocks)']
    """
    needs = []
    if pipeline_parallel_size > 1:
        needs.append(f"`pipeline_parallel_size={pipeline_parallel_size}` (the pipeline stages are cut between blocks)")
    if activation_checkpointing == "selective":
        needs.append("`activation_checkpointing='selective'` (each block's pointwise ops are recomputed in backward)")
    elif activation_checkpointing:
        needs.append("`activation_checkpointing=True` (each block is recomputed in the backward pass)")
    if tensor_parallel_auto_plan:
        needs.append("`tensor_parallel_plan='auto'` (the plan is read from the layers of the blocks)")
    if sequence_parallel:
        needs.append("`sequence_parallel=True` (the sequence is split from the first block to the last)")
    return needs


def _block_lists(root: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(parameter count, name, module) of every non-empty nn.ModuleList/nn.Sequential of same-type modules with
    parameters: the candidates for the repeated block list."""
    found = []
    for name, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = _num_params(module)
        if size > 0:
            found.append((size, name, module))
    return found


def other_block_lists(root: nn.Module, blocks_name: str) -> list[str]:
    """The block lists of ``root`` beside ``blocks_name``: each an nn.ModuleList/nn.Sequential of same-type modules,
    outside it (and not around it), whose blocks hold at least a quarter of the parameters of one of its blocks (an
    encoder-decoder's encoder beside its decoder; not a stem of small layers or a list of heads), outermost only.

    Example:
        >>> from torch import nn
        >>> class EncoderDecoder(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        ...         self.decoder = nn.ModuleList(nn.Linear(8, 16) for _ in range(2))
        >>> other_block_lists(EncoderDecoder(), "decoder")
        ['encoder']
    """
    chosen = root.get_submodule(blocks_name)
    per_block = _num_params(chosen) / max(len(chosen), 1)
    found: list[str] = []
    for size, name, module in sorted(_block_lists(root), key=lambda c: len(c[1].split("."))):
        if not name or _inside(name, blocks_name) or _inside(blocks_name, name) or any(_inside(name, f) for f in found):
            continue
        if size / len(module) >= per_block / 4:
            found.append(name)
    return found


def _find_block_list(
    root: nn.Module, blocks_name: Optional[str], needed_by: Sequence[str]
) -> Optional[tuple[str, nn.Module]]:
    if blocks_name is not None:
        # the fix names the block lists there are (the largest first) and the automatic search
        lists = [name for _, name, _ in sorted(_block_lists(root), key=lambda c: -c[0])]
        fix = f"Give the dotted name of one of its block lists, {lists}," if lists else "Give the dotted name of"
        fix += " an nn.ModuleList/nn.Sequential of the repeated blocks, or leave `transformer_blocks` None."
        try:
            blocks = root.get_submodule(blocks_name) if isinstance(blocks_name, str) else None
        except AttributeError:
            blocks = None
        if blocks is None:
            raise HybridConfigError(
                f"`transformer_blocks={blocks_name!r}` names no submodule of {type(root).__name__}. {fix}"
            )
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise HybridConfigError(
                f"`transformer_blocks={blocks_name!r}` is a {type(blocks).__name__}; it must name an nn.ModuleList"
                f" or nn.Sequential of the repeated blocks. {fix}"
            )
        return blocks_name, blocks
    best = max(_block_lists(root), key=lambda c: c[0], default=None)  # the first of the largest
    if best is None:
        if not needed_by:
            return None  # data parallel and ZeRO train any module without one
        raise HybridConfigError(
            f"Could not find the repeated transformer blocks in {type(root).__name__} (no nn.ModuleList or"
            f" nn.Sequential of same-type modules with parameters), and {' and '.join(needed_by)}"
            f" {'needs' if len(needed_by) == 1 else 'need'} them. Pass"
            " `HybridStrategy(transformer_blocks='<name of the block list>')`, or train this module with data"
            " parallel and ZeRO alone, which need no block list."
        )
    return best[1], best[2]


def find_model_structure(
    root: nn.Module, blocks_name: Optional[str] = None, needed_by: Sequence[str] = ()
) -> ModelStructure:
    """Locate the block list, the network that owns it, the token embedding, the vocabulary head and tied weights.

    Without a block list the structure has ``blocks_name=None`` and the whole module as its network, unless
    ``needed_by`` (from :func:`block_list_needed_by`) names settings that need one: then ``HybridConfigError``.

    Example:
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = nn.Embedding(32, 8)
        ...         self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        ...         self.head = nn.Linear(8, 32)
        >>> s = find_model_structure(Net())
        >>> (s.blocks_name, s.token_embedding_name, s.output_head_name)
        ('blocks', 'emb', 'head')
        >>> find_model_structure(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten())).blocks_name is None
        True
    """
    found = _find_block_list(root, blocks_name, needed_by)
    name, blocks = found if found is not None else (None, None)
    network_name = name.split(".")[0] if name is not None and "." in name else ""
    network = root.get_submodule(network_name) if network_name else root
    prefix = f"{network_name}." if network_name else ""

    outside = [
        (f"{prefix}{n}" if n else network_name, m)
        for n, m in network.named_modules()
        if name is None or not _inside(n, name[len(prefix) :])
    ]
    token_embedding, head = embedding_and_head(outside)

    tied: list[tuple[str, str]] = []
    seen: dict[int, str] = {}
    for pname, p in root.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append((seen[id(p)], pname))
        else:
            seen[id(p)] = pname
    return ModelStructure(
        network_name=network_name,
        blocks_name=name,
        num_blocks=len(blocks) if blocks is not None else 0,
        token_embedding_name=token_embedding[0] if token_embedding else None,
        output_head_name=head[0] if head else None,
        tied_parameters=tied,
    )


def embedding_and_head(
    outside: Sequence[tuple[str, nn.Module]],
) -> tuple[Optional[tuple[str, nn.Module]], Optional[tuple[str, nn.Module]]]:
    """The token embedding and the vocabulary head among the modules outside the block list, by shape alone (not by
    registration order): the token embedding is the one whose vocabulary a Linear predicts (a position table can be
    larger than the vocabulary), that Linear (the last such) is the head; without such a head, the first embedding
    registered and no head."""
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    linears = [(n, m) for n, m in outside if isinstance(m, nn.Linear)]
    for name_e, emb in embeddings:
        heads = [(n, m) for n, m in linears if m.out_features == emb.num_embeddings]
        if heads:
            return (name_e, emb), heads[-1]
    return (embeddings[0] if embeddings else None), None


def _inside(name: str, blocks_name: str) -> bool:
    return name == blocks_name or name.startswith(blocks_name + ".")


def state_dict_name(name: str) -> str:
    """A parameter's name as its state-dict key: without the module wrappers torch inserts into parameter names.

    Example:
        >>> state_dict_name("h.0._checkpoint_wrapped_module.attn.weight")
        'h.0.attn.weight'
    """
    for part in WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name
