"""Finding the shape of a transformer inside a LightningModule: its repeated block list, token embedding and head.

Tensor parallel (which layers to shard), ZeRO-3 (what to wrap), activation checkpointing (what to recompute) and the
pipeline (where to cut) all need the same answer, so it is found once, here, and never per feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_hybrid.config import HybridConfigError

__all__ = ["ModelStructure", "find_model_structure"]


@dataclass
class ModelStructure:
    """Where the parts of a transformer live, as fully qualified names relative to the LightningModule."""

    network_name: str
    """The module that owns the block list and is called by ``training_step`` ("" is the LightningModule itself)."""
    blocks_name: str
    """The repeated ``nn.ModuleList``/``nn.Sequential`` of transformer blocks."""
    num_blocks: int
    token_embedding_name: Optional[str] = None
    output_head_name: Optional[str] = None
    tied_parameters: list[tuple[str, str]] = field(default_factory=list)
    """Pairs of parameter names that are one tensor (e.g. input embedding and output head)."""

    def block_names(self) -> list[str]:
        return [f"{self.blocks_name}.{i}" for i in range(self.num_blocks)]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _find_block_list(root: nn.Module, blocks_name: Optional[str]) -> tuple[str, nn.Module]:
    if blocks_name is not None:
        try:
            blocks = root.get_submodule(blocks_name)
        except AttributeError:
            raise HybridConfigError(
                f"`transformer_blocks={blocks_name!r}` names no submodule of {type(root).__name__}."
            ) from None
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise HybridConfigError(
                f"`transformer_blocks={blocks_name!r}` is a {type(blocks).__name__}; it must name an nn.ModuleList"
                " or nn.Sequential of the repeated blocks."
            )
        return blocks_name, blocks
    best: Optional[tuple[int, str, nn.Module]] = None
    for name, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        size = _num_params(module)
        if size > 0 and (best is None or size > best[0]):
            best = (size, name, module)
    if best is None:
        raise HybridConfigError(
            f"Could not find the repeated transformer blocks in {type(root).__name__}: no nn.ModuleList or"
            " nn.Sequential of same-type modules with parameters. Pass"
            " `HybridStrategy(transformer_blocks='<name of the block list>')`."
        )
    return best[1], best[2]


def find_model_structure(root: nn.Module, blocks_name: Optional[str] = None) -> ModelStructure:
    """Locate the block list, the network that owns it, the token embedding, the vocabulary head and tied weights.

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
    """
    name, blocks = _find_block_list(root, blocks_name)
    network_name = name.split(".")[0] if "." in name else ""
    network = root.get_submodule(network_name) if network_name else root
    prefix = f"{network_name}." if network_name else ""

    outside = [
        (f"{prefix}{n}" if n else network_name, m)
        for n, m in network.named_modules()
        if not _inside(n, name[len(prefix) :])
    ]
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    linears = [(n, m) for n, m in outside if isinstance(m, nn.Linear)]
    # the token embedding is the one whose vocabulary the output head predicts (a position table can be larger
    # than the vocabulary); without such a head, the first embedding registered
    token_embedding, head = None, None
    for name_e, emb in embeddings:
        heads = [(n, m) for n, m in linears if m.out_features == emb.num_embeddings]
        if heads:
            token_embedding, head = (name_e, emb), heads[-1]
            break
    if token_embedding is None and embeddings:
        token_embedding = embeddings[0]

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
        num_blocks=len(blocks),
        token_embedding_name=token_embedding[0] if token_embedding else None,
        output_head_name=head[0] if head else None,
        tied_parameters=tied,
    )


def _inside(name: str, blocks_name: str) -> bool:
    return name == blocks_name or name.startswith(blocks_name + ".")
