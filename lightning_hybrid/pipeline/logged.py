"""What the user's step logs under pipeline parallel: collected per micro-batch on the last stage without Lightning's
``self.log`` (:class:`LogCollector`), then given to Lightning by the name's own ``reduce_fx`` (:func:`reduction`): a
mean (the default) once per step, the micro-batches' mean weighted by their sizes (what a single-device step over the
whole batch gives); a sum, max or min once per micro-batch, as ``"ddp"`` with the micro-batches as accumulated batches
(each a call of the step) logs them. Either way Lightning's epoch value is that ``"ddp"``'s: a ``"sum"`` counts every
micro-batch. As float64 tensors for the runner's one-tensor broadcast (:func:`scalar_means`), or as Python values for
its object broadcast (:func:`merge_records`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import attribute_replaced
from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.pipeline.step_data import LogRecord

__all__ = ["REDUCTIONS", "LogCollector", "log_dtype", "merge_records", "reduction", "scalar_means"]


class LogCollector:
    """Stands in for ``LightningModule.log`` while the runner runs the user's step: each call is kept in ``sink``
    (the current micro-batch's records on the last stage; values detached, DTensors made plain), or dropped when
    ``sink`` is None (capturing the network's inputs, the verifier's reference). Lightning's own ``log`` runs once
    per name per step, on the merged values (:meth:`StepResults.log`)."""

    def __init__(self) -> None:
        self.sink: Optional[list[LogRecord]] = None

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        sink = self.sink
        if sink is None:
            return
        if isinstance(value, Tensor):  # the common case, without apply_to_collection's walk
            value = (to_plain(value) if isinstance(value, DTensor) else value).detach().clone()
        else:
            value = apply_to_collection(value, DTensor, to_plain)
            value = apply_to_collection(value, Tensor, lambda t: t.detach().clone())
        sink.append((name, value, args, kwargs))

    def installed(self, module: nn.Module) -> Any:
        """``module.log`` is this collector meanwhile (a context manager)."""
        return attribute_replaced(module, "log", self)


REDUCTIONS: dict[Any, str] = {"mean": "mean", "avg": "mean", torch.mean: "mean", "sum": "sum", torch.sum: "sum",
                              "max": "max", torch.max: "max", "min": "min", torch.min: "min"}  # fmt: skip
"""Lightning's ``reduce_fx`` names (and the torch functions it accepts) -> the reduction they name."""


def reduction(log_kwargs: dict[str, Any]) -> str:
    """How Lightning reduces a logged value over an epoch's steps (``reduce_fx``, mean by default): ``"mean"``,
    ``"sum"``, ``"max"`` or ``"min"``; the micro-batches' values merge the same way.

    Example:
        >>> reduction({"reduce_fx": "sum"}), reduction({})
        ('sum', 'mean')
    """
    try:
        return REDUCTIONS.get(log_kwargs.get("reduce_fx", "mean"), "mean")
    except TypeError:  # an unhashable callable: Lightning itself only knows the four
        return "mean"


def log_dtype() -> torch.dtype:
    """The dtype ``LightningModule.log`` gives a Python number (the object path logs floats)."""
    dtype = torch.get_default_dtype()
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. a tensor among the kwargs: no single truth value
        return False


def _entries(per_microbatch: list[list[LogRecord]]) -> list[tuple[str, list[Any], list[float], tuple, dict]]:
    """What Lightning's ``log`` is called with for the step, in first-logged order: (name, values, weights, args,
    kwargs). A mean-reduced name (the default) is one entry, its values the micro-batches' and weighted in the
    batch's mean: by ``batch_size=`` where given, then logged with the micro-batches' total (Lightning weights a
    step's value by its batch size in the epoch mean, and the batch is the micro-batches together); else equally
    (Lightning sizes the batch itself). A name reduced by ``"sum"``, ``"max"`` or ``"min"`` is one entry per
    micro-batch, as under ``"ddp"`` with the micro-batches as accumulated batches (each a call of the step):
    Lightning's epoch reduction then counts each, and the step's value is the last micro-batch's."""
    merged: dict[str, tuple[list[Any], list[Any], tuple, dict]] = {}
    for records in per_microbatch:
        for name, value, args, kwargs in records:
            values, weights, _, _ = merged.setdefault(name, ([], [], args, kwargs))
            values.append(value)
            weights.append(kwargs.get("batch_size"))
    entries = []
    for name, (values, weights, args, kwargs) in merged.items():
        if reduction(kwargs) != "mean":
            entries += [(name, [v], [1], args, kwargs) for v in values]
        elif all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in weights):
            entries.append((name, values, weights, args, {**kwargs, "batch_size": sum(weights)}))
        else:  # no batch size given (or not a positive number): a plain mean, Lightning sizes the batch itself
            entries.append((name, values, [1] * len(values), args, kwargs))
    return entries


def scalar_means(
    per_microbatch: list[list[LogRecord]], schema: list[tuple[str, tuple, dict]], device: torch.device
) -> Optional[list[Tensor]]:
    """The values to log (:func:`_entries`: a mean-reduced name's micro-batch mean, another's value per micro-batch)
    as float64 tensors on ``device`` (no host sync), in the schema's order; None when the records do not fit the
    schema (other names, order or arguments, or a value that is not a number), as :func:`merge_records` would give
    them."""
    entries = _entries(per_microbatch)
    if len(entries) != len(schema):
        return None
    means = []
    for (name, args, kwargs), (entry, values, weights, entry_args, entry_kwargs) in zip(schema, entries):
        if name != entry or not _same(args, entry_args) or not _same(kwargs, entry_kwargs):
            return None
        column = _weighted_column(values, weights, device)
        if column is None:
            return None
        total = sum(weights)
        means.append((column.sum() / total) if len(column) > 1 else column[0] / total)
    return means


def _weighted_column(values: list[Any], weights: list[float], device: torch.device) -> Optional[Tensor]:
    """One logged name's values times their weights, as a float64 vector on ``device``; None where a value is not a
    number. The usual case (one-element tensors of one dtype, unit weights: one ``self.log`` of a loss per
    micro-batch) is one stack and one conversion instead of a few tensor operations per micro-batch; each element
    is the same float64 number either way (float64 holds every float32, and a product by 1 is exact)."""
    if all(isinstance(v, Tensor) for v in values):
        if any(v.numel() != 1 or v.is_complex() for v in values):
            return None
        if len({v.dtype for v in values}) == 1 and len({v.device for v in values}) == 1:
            column = torch.stack([v.reshape(()) for v in values]).to(device=device, dtype=torch.float64)
            if all(w == 1 for w in weights):
                return column
            return column * torch.tensor(weights, dtype=torch.float64, device=device)
    parts = []
    for v, w in zip(values, weights):
        if isinstance(v, Tensor):
            if v.numel() != 1 or v.is_complex():
                return None
            parts.append(v.reshape(1).to(device=device, dtype=torch.float64) * w)
        elif isinstance(v, (float, int)) and not isinstance(v, bool):
            parts.append(torch.tensor([float(v) * w], dtype=torch.float64, device=device))
        else:
            return None
    return torch.cat(parts)


def _to_cpu(obj: Any) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


def merge_records(per_microbatch: list[list[tuple[str, Any, tuple, dict]]]) -> list[tuple[str, Any, tuple, dict]]:
    """The records to log, in first-logged order (:func:`_entries`): a mean-reduced name once, its micro-batches'
    mean (weighted by their ``batch_size`` where one is logged, as a single-device step over the whole batch gives
    it); a name reduced by sum, max or min once per micro-batch."""
    out = []
    for name, values, weights, args, kwargs in _entries(per_microbatch):
        if all(isinstance(v, (Tensor, float, int)) and not isinstance(v, bool) for v in values):
            value: Any = float(sum(float(v) * w for v, w in zip(values, weights)) / sum(weights))
        else:
            value = values[-1]
        out.append((name, _to_cpu(value), args, kwargs))
    return out
