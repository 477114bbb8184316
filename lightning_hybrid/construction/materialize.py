"""Give a module split and sharded on the meta device its real tensors: allocate this rank's shards, then replay the
recorded construction and copy each tensor's local part in as soon as its value is final.

The targets are taken before the model is split (:func:`construction_targets`), as (owning module, attribute) pairs:
tensor parallel and ZeRO-3 replace a parameter by a DTensor on the same module, so the pair still finds it after the
split, and the pipeline cut drops whole blocks, whose pairs then find nothing and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_hybrid._torch_compat import reinstall_tensor_hooks
from lightning_hybrid.construction.record import ConstructionRecord, StorageView
from lightning_hybrid.construction.replay import ReplayReport, replay

__all__ = ["ConstructionTargets", "allocate", "construction_targets", "has_meta_tensors", "materialize"]


@dataclass(frozen=True)
class _Target:
    owner: nn.Module
    attribute: str
    kind: str  # "parameter", "buffer" or "attribute" (a plain tensor attribute of a module)
    view: StorageView
    name: str  # the fully qualified name, for messages


@dataclass
class ConstructionTargets:
    """The meta tensors of a module, by storage, with the record that can rebuild them."""

    record: ConstructionRecord
    by_storage: dict[int, list[_Target]]
    unknown: list[str]
    """Meta tensors the record did not make (built on meta outside the strategy's construction context)."""

    def name_of(self, key: int) -> str:
        return self.by_storage[key][0].name


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterable[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def construction_targets(module: nn.Module, record: ConstructionRecord) -> ConstructionTargets:
    """Every meta parameter, buffer and tensor attribute of ``module``, by the storage the record knows it by."""
    by_storage: dict[int, list[_Target]] = {}
    unknown: list[str] = []
    seen: set[tuple[int, str]] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        named = [
            *(("parameter", n, t) for n, t in owner.named_parameters(recurse=False, remove_duplicate=False)),
            *(("buffer", n, t) for n, t in owner.named_buffers(recurse=False, remove_duplicate=False)),
            *(("attribute", n, t) for n, t in vars(owner).items() if isinstance(t, Tensor) and n[:2] != "__"),
        ]
        for kind, attribute, t in named:
            if t is None or not t.is_meta or (id(owner), attribute) in seen:
                continue
            seen.add((id(owner), attribute))
            name = f"{prefix}.{attribute}" if prefix else attribute
            if not record.knows(t):
                unknown.append(name)
                continue
            view = StorageView.of(t)
            by_storage.setdefault(view.storage, []).append(_Target(owner, attribute, kind, view, name))
    return ConstructionTargets(record, by_storage, unknown)


def allocate(module: nn.Module, device: torch.device) -> None:
    """Real, uninitialized storage for every meta tensor this rank still holds (its shards: DTensors allocate their
    local part); real tensors are left as they are.

    Each tensor keeps its identity: the meta object becomes the real one in place (``torch.utils.swap_tensors``), so
    whatever took a parameter before materialization still holds the one that trains: a weight tied on two modules
    (a head tied to the embedding, in the model and in an unsplit copy), the pipeline's shared-parameter table, the
    tensor-parallel gradient sums, a hook registered on it (installed again on the real tensor's autograd record).
    ``nn.Module._apply``, which ``to_empty`` uses, makes a new ``Parameter`` for a plain tensor that changes device,
    one per module that registers it: ties broke and those tables kept the meta tensors. DTensors (tensor parallel,
    ZeRO-3's shards) still go through ``_apply``, which swaps them in place too and lets FSDP2 re-point its sharded
    storage at the new local tensors."""
    pending: dict[int, Tensor] = {}
    for owner in module.modules():
        held = [
            *(t for _, t in owner.named_parameters(recurse=False, remove_duplicate=False)),
            *(t for _, t in owner.named_buffers(recurse=False, remove_duplicate=False)),
            *(t for n, t in vars(owner).items() if n[:2] != "__"),
        ]
        plain = (t for t in held if isinstance(t, Tensor) and type(t) in (Tensor, nn.Parameter))
        pending.update((id(t), t) for t in plain if t.is_meta)
    # a tensor a view still refers to cannot be swapped until the view is (its record is then let go): a second round;
    # what is left (held from outside the module) is made anew on its owners by _apply below, as to_empty does
    for _ in range(2):
        pending = {key: t for key, t in pending.items() if not _made_real_in_place(t, device)}
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for t in module.parameters():  # hooks registered on a parameter before (the swaps left them on the meta record)
        reinstall_tensor_hooks(t)
    for owner in module.modules():  # tensor attributes _apply does not see (of a subclass type, or held from outside)
        for attribute, t in list(vars(owner).items()):
            if isinstance(t, Tensor) and t.is_meta and attribute[:2] != "__":
                setattr(owner, attribute, torch.empty_like(t, device=device))


def _made_real_in_place(t: Tensor, device: torch.device) -> bool:
    """Swap real storage into ``t``; False where something else holds its record (a view of it)."""
    with torch.no_grad():
        real = torch.empty_like(t, device=device)
    replacement = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real
    replacement.__dict__.update(t.__dict__)  # the swap exchanges the objects' attributes too: keep t's
    try:
        torch.utils.swap_tensors(t, replacement)
    except RuntimeError:
        return False
    return True


def materialize(module: nn.Module, targets: ConstructionTargets, device: torch.device) -> ReplayReport:
    """Allocate ``module``'s local shards on ``device`` and fill them with the values one device's construction
    gives.

    Example:
        >>> from lightning_hybrid.construction import record_construction
        >>> _ = torch.manual_seed(0)
        >>> with record_construction() as record:
        ...     net = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
        >>> _ = materialize(net, construction_targets(net, record), torch.device("cpu"))
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(net[0].weight, nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))[0].weight)
        True
    """
    from lightning_hybrid.checkpoint.tensors import copy_local_part

    allocate(module, device)
    held = {id(m) for m in module.modules()}

    def fill(key: int, view: object) -> None:
        for target in targets.by_storage[key]:
            if id(target.owner) not in held:
                continue  # in a block another pipeline rank holds
            current = getattr(target.owner, target.attribute)
            if current is None or not isinstance(current, Tensor):
                continue
            with torch.no_grad():
                value = view(target.view)  # type: ignore[operator]
                copy_local_part(value.to(current.dtype), current.detach() if current.requires_grad else current)

    return replay(targets.record, device, targets.by_storage, fill)
