"""Tensors as DCP sees them: fused-projection views on save, and load targets that fit what a checkpoint holds.

DCP reshards a tensor between layouts by itself when the saved and the requested global shapes agree. The one case
where they do not is a fused projection (q|k|v) split by tensor parallel: its ``_StridedShard`` placement has no
rectangular chunk per rank, so it is saved through a ``[k, rows/k, ...]`` view (see :func:`dcp_ready`), while the same
weight in a layout without tensor parallel is a plain ``[rows, ...]`` tensor. :func:`plan_load` matches the two: the
same view where it fits, and otherwise a full temporary of that one tensor whose local part is copied afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_hybrid._torch_compat import compute_local_shape_and_global_offset
from lightning_hybrid.dtensor import is_fused, like, unstrided

__all__ = ["LoadPlan", "conflicting_entries", "copy_local_part", "dcp_ready", "plan_load"]


def _at_offset_zero(t: DTensor) -> DTensor:
    """``t`` over a local tensor that starts at storage offset 0 and aliases the same bytes.

    A DTensor takes the storage offset of its local tensor (torch >= 2.10), and ``Tensor.__deepcopy__`` copies a
    wrapper with a nonzero offset through the wrapper's own storage, which is empty: "Attempted to call copy_() on an
    invalid python storage". DCP's asynchronous staging deep-copies every CPU DTensor, and ZeRO-1/2's optimizer state
    is saved as views into the flat shards (no copy), so every such view but the first would fail. A storage slice
    starting at the view's first byte aliases the same memory without copying it, so saves still read, and loads
    still write, the live tensors.
    """
    local = t.to_local()
    if local.storage_offset() == 0:
        return t
    storage = local.untyped_storage()
    start = local.storage_offset() * local.element_size()
    alias = local.new_empty(0).set_(storage[start:], 0, local.shape, local.stride())
    return like(alias, t)


def dcp_ready(tree: Any) -> Any:
    """``tree`` with every strided (fused-projection) DTensor replaced by its DCP-friendly view, and every DTensor
    whose local tensor is a view at a storage offset re-wrapped over an alias at offset 0 (see
    :func:`_at_offset_zero`). The results share storage with the originals, so a DCP load into them fills the
    originals in place.

    Example:
        >>> dcp_ready({"w": torch.zeros(2)})["w"].shape
        torch.Size([2])
    """
    if isinstance(tree, DTensor):
        return _at_offset_zero(unstrided(tree) if is_fused(tree) else tree)
    if isinstance(tree, dict):
        return {k: dcp_ready(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [dcp_ready(v) for v in tree]
    return tree


def _block_view_of(viewed: tuple[int, ...], natural: tuple[int, ...]) -> bool:
    """Whether ``viewed`` is ``natural`` with its first dimension split in blocks: ``[k, rows/k, ...]``."""
    return len(viewed) == len(natural) + 1 and viewed[0] * viewed[1] == natural[0] and viewed[2:] == natural[1:]


@dataclass
class _Deferred:
    full: Tensor  # the whole tensor in the saved shape, filled by DCP
    target: Tensor  # the live tensor whose local part is cut from it after the load


@dataclass
class LoadPlan:
    """What to hand to ``dcp.load`` and what to finish afterwards.

    ``request`` maps checkpoint keys to tensors DCP fills in place (live storage, views of it, or temporaries);
    ``errors`` lists keys that cannot load (missing, or saved with another shape), with the reason.
    """

    request: dict[str, Any]
    deferred: list[_Deferred]
    errors: list[str]

    @torch.no_grad()
    def finish(self) -> None:
        """Copy each temporary's local part into its live tensor (after ``dcp.load``)."""
        for item in self.deferred:
            copy_local_part(item.full, item.target)


def plan_load(targets: dict[str, Any], metadata: Metadata, describe: dict[str, str] | None = None) -> LoadPlan:
    """Match live tensors (``{checkpoint key: tensor}``; non-tensors load as objects) against a checkpoint's metadata.

    ``describe`` maps a key to the words used for it in an error (default: the key).

    Example:
        >>> # plan = plan_load({"state_dict.w": module.w}, FileSystemReader(path).read_metadata())
        >>> # dcp.load(plan.request, checkpoint_id=path); plan.finish()
    """
    stored = metadata.state_dict_metadata
    request: dict[str, Any] = {}
    deferred: list[_Deferred] = []
    errors: list[str] = []
    for key, target in targets.items():
        name = (describe or {}).get(key, f"`{key}`")
        md = stored.get(key)
        if md is None:
            errors.append(f"{name}: not in the checkpoint")
            continue
        if not isinstance(target, Tensor):
            request[key] = target
            continue
        if not isinstance(md, TensorStorageMetadata):
            errors.append(f"{name}: the checkpoint holds a {type(md).__name__}, the model a tensor")
            continue
        saved, natural = tuple(md.size), tuple(target.shape)
        view = dcp_ready(target)
        if tuple(view.shape) == saved:
            request[key] = view
        elif not isinstance(target, DTensor) and _block_view_of(saved, natural) and target.is_contiguous():
            request[key] = target.view(saved)  # a fused weight saved under tensor parallel, loaded whole
        elif _block_view_of(saved, natural) or _block_view_of(natural, saved) or saved == natural:
            # a fused weight whose saved and live layouts share no chunk shape: read it whole, keep the local part
            full = torch.empty(saved, dtype=md.properties.dtype)
            request[key] = full
            deferred.append(_Deferred(full, target))
        else:
            errors.append(f"{name}: the checkpoint holds shape {list(saved)}, the model {list(natural)}")
    return LoadPlan(request, deferred, errors)


def copy_local_part(full: Tensor, target: Union[Tensor, DTensor]) -> None:
    view = dcp_ready(target)
    whole = full.reshape(view.shape)
    if not isinstance(view, DTensor):
        view.copy_(whole)
        return
    sizes, offsets = compute_local_shape_and_global_offset(view.shape, view.device_mesh, view.placements)
    piece = whole
    for dim, (size, offset) in enumerate(zip(sizes, offsets)):
        piece = piece.narrow(dim, offset, size)
    view.to_local().copy_(piece)


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per step of the checksum: bounds its temporaries


def _checksum(tensor: Tensor) -> int:
    """A bitwise checksum: the raw bits as integers weighted by position (int64 arithmetic wraps deterministically),
    taken in chunks so a large tensor needs no full-size temporary."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    bits = flat.view(_INT_OF_WIDTH.get(flat.element_size(), torch.uint8))
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
        total += (part * weights).sum()
    return int(total)


def _piece(value: Tensor) -> tuple[tuple[int, ...], Tensor]:
    """(global offset of this rank's piece, the piece) of a tensor DCP will write."""
    if not isinstance(value, DTensor):
        return (0,) * value.dim(), value
    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(offsets), value.to_local()


def conflicting_entries(flat: dict[str, Any]) -> list[str]:
    """Checkpoint keys that two ranks are about to write with different values (the same key and piece offset, other
    bits): DCP would keep one rank's copy and drop the other, silently. Collective (one object all-gather of a
    checksum per tensor); the same list on every rank.

    Example:
        >>> # problems = conflicting_entries(flat)  # [] when every replicated entry agrees bit for bit
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    mine = {}
    for key, value in flat.items():
        if isinstance(value, Tensor):
            offsets, piece = _piece(value)
            # the dtype belongs to the value: equal bits of another dtype are another value
            mine[(key, offsets)] = (_checksum(piece), str(piece.dtype), tuple(piece.shape))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    first: dict[tuple[str, tuple[int, ...]], tuple[int, Any]] = {}
    problems: dict[str, str] = {}
    for rank, entries in enumerate(gathered):
        for where, digest in entries.items():
            seen = first.setdefault(where, (rank, digest))
            if seen[1] != digest and where[0] not in problems:
                problems[where[0]] = f"`{where[0]}`: rank {seen[0]} and rank {rank} hold different values"
    return list(problems.values())
