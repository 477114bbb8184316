"""torchmetrics in a 3D run: metric states are reduced over the data-parallel replicas only, and fed plain tensors."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

__all__ = ["sync_metrics_over"]


def sync_metrics_over(module: nn.Module, process_group: Any) -> int:
    """Make every ``torchmetrics.Metric`` inside ``module`` synchronize over ``process_group`` (the data-parallel
    group): tensor and pipeline peers see the same samples, so reducing over them too would count each sample
    several times. Metrics given an explicit ``process_group`` by the user keep it. Also lets ``update`` take the
    DTensors a tensor-parallel model produces (a vocabulary-parallel loss, sharded logits): they arrive as plain
    tensors, as on one device. Returns how many metrics were set.

    Example:
        >>> import torchmetrics
        >>> module = nn.Module()
        >>> module.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        >>> sync_metrics_over(module, process_group=None)  # no group: nothing to change
        0
    """
    if process_group is None:
        return 0
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional for users who log plain tensors
        return 0
    count = 0
    for child in module.modules():
        if isinstance(child, Metric) and not getattr(child, "_lightning_hybrid_synced", False):
            if getattr(child, "process_group", None) is None:
                child.process_group = process_group
            child.update = _plain_inputs(child.update)  # type: ignore[method-assign]
            child._lightning_hybrid_synced = True
            count += 1
    return count


def _plain_inputs(update: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.dtensor import to_plain

    @functools.wraps(update)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args = apply_to_collection(args, DTensor, to_plain)
        kwargs = apply_to_collection(kwargs, DTensor, to_plain)
        return update(*args, **kwargs)

    return wrapped
