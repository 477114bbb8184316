"""Splitting one optimizer step's batch into micro-batches, and merging per-micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_hybrid.config import HybridConfigError

__all__ = ["batch_size_of", "merge_microbatches", "split_batch"]


def batch_size_of(batch: Any) -> int | None:
    """Size of dim 0 of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        items = batch
    else:
        return None
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def _rebuild(batch: Any, parts: list[Any]) -> Any:
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*parts)
    return type(batch)(parts)


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor whose dim 0 is the batch size into ``num_microbatches`` equal chunks; keep everything else.

    Example:
        >>> [x.tolist() for x, _ in split_batch((torch.arange(4), "meta"), 2)]
        [[0, 1], [2, 3]]
    """
    size = batch_size_of(batch)
    if size is None:
        raise HybridConfigError("Pipeline parallel splits the batch along dim 0, but the batch holds no tensor.")
    if size % num_microbatches:
        raise HybridConfigError(
            f"The batch size ({size}) is not divisible by `num_microbatches={num_microbatches}`. Make the"
            " DataLoader's batch size a multiple of it (and use drop_last=True so the last batch is too)."
        )

    def split(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == size:
            return list(obj.chunk(num_microbatches))
        if isinstance(obj, Mapping):
            columns = {k: split(v) for k, v in obj.items()}
            out = []
            for i in range(num_microbatches):
                item = {k: c[i] for k, c in columns.items()}
                try:
                    out.append(type(obj)(item))
                except TypeError:
                    out.append(item)
            return out
        if isinstance(obj, (list, tuple)):
            columns = [split(v) for v in obj]
            return [_rebuild(obj, [c[i] for c in columns]) for i in range(num_microbatches)]
        return [obj] * num_microbatches

    return split(batch)


def merge_microbatches(outputs: list[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 (tensors), recursively through dicts/lists/tuples."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if first.dim() > 0 else torch.stack(outputs).mean(0)
    if isinstance(first, Mapping):
        return type(first)({k: merge_microbatches([o[k] for o in outputs]) for k in first})
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [merge_microbatches([o[i] for o in outputs]) for i in range(len(first))])
    return first
