"""Parameters that more than one pipeline stage holds, and which stage owns each.

Every parameter has exactly one owning stage. Most belong to one stage's modules (its blocks, the first stage's input
modules, the last stage's output modules). Two kinds are held by several pipeline ranks:

* **tied** weights whose names fall on different stages (an output head tied to the word embedding);
* **loose** parameters that belong to no stage's modules: a bare ``nn.Parameter`` on the network (a learned position
  embedding ``self.pos_emb`` added before the blocks, GPT/ViT style) or on the LightningModule outside the network.
  No module swap can tell which stage's part of ``forward`` reads them, so every stage keeps them.

Both are treated alike, as Megatron treats tied embeddings: every holder keeps a copy, their gradients are summed over
the holders each step (a stage that did not use the parameter adds nothing), so every copy takes the same update.
The lowest pipeline rank holding a tensor owns it: the others' copies count zero in the global gradient norm, and a
checkpoint entry (weight, optimizer state, master copy) that several stages would write under one name is written by
the owner alone.

What each rank holds is gathered at set-up, so a tied tensor whose copies are laid out differently on two stages
(another tensor-parallel split, dtype or shape) is refused there, with the same error on every rank, instead of
failing inside the gradient all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import local_grad
from lightning_hybrid.pipeline.stage import NetworkSplit
from lightning_hybrid.process_groups import subgroup
from lightning_hybrid.structure import state_dict_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SharedParameters", "find_shared_parameters"]


@dataclass
class _Shared:
    key: str
    param: nn.Parameter
    holders: tuple[int, ...]


@dataclass
class SharedParameters:
    """This rank's parameters that other pipeline ranks also hold, grouped by the set of ranks that hold them.

    Example:
        >>> # shared = find_shared_parameters(module, split, tied_pairs, mesh)
        >>> # shared.sync()  # every step, after backward: sum the copies' gradients over their holders
    """

    groups: list[tuple[Any, list[_Shared]]] = field(default_factory=list)
    duplicates: list[nn.Parameter] = field(default_factory=list)
    """Copies owned by another pipeline rank: left out of the global gradient norm."""
    not_owned: set[str] = field(default_factory=set)
    """Parameter names that a lower pipeline rank also holds under the same name: it writes their checkpoint
    entries, this rank does not."""
    loose: list[str] = field(default_factory=list)
    """Names of parameters outside every stage's modules (held by every stage)."""

    def sync(self) -> None:
        """Sum each shared parameter's gradient over the ranks that hold it (collective within each holder group).

        A holder that computed no gradient adds zeros; a parameter no holder computed a gradient for keeps none,
        as on one device (the optimizer then skips it)."""
        for group, entries in self.groups:
            grads = [local_grad(e.param) for e in entries]
            device = entries[0].param.device
            flags = torch.tensor([0.0 if g is None else 1.0 for g in grads], device=device)
            dist.all_reduce(flags, group=group)
            for entry, grad, used in zip(entries, grads, flags.tolist()):
                if not used:
                    continue
                if grad is None:
                    entry.param.grad = torch.zeros_like(entry.param)
                    grad = local_grad(entry.param)
                dist.all_reduce(grad, group=group)


def _layout(p: Tensor) -> tuple[tuple[int, ...], str, str]:
    local = p.to_local() if isinstance(p, DTensor) else p
    placements = str(tuple(p.placements)) if isinstance(p, DTensor) else "plain"
    return tuple(local.shape), str(p.dtype), placements


def find_shared_parameters(
    module: nn.Module, split: NetworkSplit, tied: list[tuple[str, str]], mesh: DeviceMesh
) -> SharedParameters:
    """Find the parameters several pipeline ranks hold, check their copies agree, and build their gradient groups.

    Collective over all ranks (one object all-gather, then ``new_group`` for holder sets that are not the whole
    pipeline); every rank raises the same :class:`HybridConfigError` if copies of one tensor differ in layout.
    ``tied`` are the model's pairs of names for one tensor (``ModelStructure.tied_parameters``), found before the
    split.

    Example:
        >>> # shared = find_shared_parameters(module, split, structure.tied_parameters, strategy.device_mesh)
    """
    pp_rank = mesh["pipeline"].get_local_rank()
    coordinate = (mesh["data"].get_local_rank(), mesh["tensor"].get_local_rank())
    canonical: dict[str, str] = {}
    for first, second in tied:
        canonical[second] = canonical.get(first, first)
    in_stages = {id(p) for s in split.local_stages() for m in split.stage_modules(s) for p in m.parameters()}
    by_id: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), (p, []))[1].append(name)
    mine: dict[str, tuple[nn.Parameter, list[str], bool]] = {}
    for p, names in by_id.values():
        loose = id(p) not in in_stages
        if loose or any(n in canonical or n in canonical.values() for n in names):
            mine[canonical.get(names[0], names[0])] = (p, names, loose)
    record = {key: (*_layout(p), tuple(names), loose) for key, (p, names, loose) in mine.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pp_rank, coordinate, record))

    # key -> coordinate -> pipeline rank -> (shape, dtype, placements, names, loose)
    table: dict[str, dict[tuple[int, int], dict[int, tuple]]] = {}
    for rank_pp, rank_coordinate, rank_record in gathered:
        for key, info in rank_record.items():
            table.setdefault(key, {}).setdefault(rank_coordinate, {})[rank_pp] = info
    problems: list[str] = []
    holders_of: dict[str, tuple[int, ...]] = {}
    for key in sorted(table):
        for holders in table[key].values():
            layouts = {h: info[:3] for h, info in sorted(holders.items())}
            if len(set(layouts.values())) > 1:
                shown = "; ".join(
                    f"pipeline rank {h} holds {'/'.join(holders[h][3])} as {shape} {dtype} {placements}"
                    for h, (shape, dtype, placements) in layouts.items()
                )
                problems.append(f"{key!r}: {shown}")
                break
        holders_of[key] = tuple(sorted(next(iter(table[key].values()))))
    if problems:
        raise HybridConfigError(
            "Under pipeline parallel, these tied (or shared) parameters are held by several stages in different"
            " layouts, so their gradients cannot be summed: " + " | ".join(problems) + ". Split every copy of a tied"
            " tensor the same way (a vocab-parallel embedding with a column-wise head, or neither in"
            " `tensor_parallel_plan`), or untie them."
        )

    shared = SharedParameters()
    pp_size = mesh["pipeline"].size()
    by_holders: dict[tuple[int, ...], list[str]] = {}
    for key, holders in holders_of.items():
        if len(holders) > 1:
            by_holders.setdefault(holders, []).append(key)
    for holders in sorted(by_holders):
        group: Optional[Any] = None
        if holders == tuple(range(pp_size)):
            group = mesh["pipeline"].get_group()
        else:
            # collective over all ranks, in the same order everywhere: one group per (data, tensor), made once per
            # process (a later fit of the same layout reuses them)
            for d in range(mesh["data"].size()):
                for t in range(mesh["tensor"].size()):
                    ranks = [int(mesh.mesh[h, d, t]) for h in holders]
                    created = subgroup(ranks)
                    if (d, t) == coordinate:
                        group = created
        entries = [_Shared(k, mine[k][0], holders) for k in by_holders[holders] if k in mine]
        if entries:
            shared.groups.append((group, entries))
        for key in by_holders[holders]:
            if key in mine and holders[0] != pp_rank:
                shared.duplicates.append(mine[key][0])
    for key, (_, names, loose) in mine.items():
        if loose:
            shared.loose.append(names[0])  # the name ``named_parameters()`` gives it
        lower = [info for h, info in table[key][coordinate].items() if h < pp_rank]
        shared.not_owned.update(state_dict_name(n) for n in names if any(n in info[3] for info in lower))
    return shared
