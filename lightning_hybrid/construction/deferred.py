"""The strategy's side of deferred construction: the constructions recorded under its ``tensor_init_context`` (a
module's ``configure_model``, ``trainer.init_module()``), the check before the model is split, and the
materialization after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.construction.materialize import (
    ConstructionTargets,
    allocate,
    construction_targets,
    has_meta_tensors,
    materialize,
)
from lightning_hybrid.construction.record import ConstructionRecord, record_construction

__all__ = ["DeferredConstruction"]


@dataclass
class DeferredConstruction:
    """What was built on the meta device, and how to give this rank its part of it.

    Example:
        >>> deferred = DeferredConstruction()
        >>> with deferred.recording("cpu", after_seed_reset=True):
        ...     net = nn.Linear(4, 4)
        >>> plan = deferred.plan(net, pipeline_partition="uniform")
        >>> _ = deferred.materialize(net, plan, torch.device("cpu"))
        >>> net.weight.is_meta
        False
    """

    records: list[ConstructionRecord] = field(default_factory=list)
    peak_bytes: int = 0
    """The most bytes the last materialization's replay held at once (besides the shards)."""

    @contextmanager
    def recording(self, device_type: str, *, after_seed_reset: bool) -> Iterator[ConstructionRecord]:
        with record_construction(device_type, after_seed_reset=after_seed_reset) as record:
            yield record
        self.records.append(record)

    def plan(self, module: nn.Module, *, pipeline_partition: object) -> list[ConstructionTargets] | None:
        """The targets of each recorded construction in ``module`` (None when nothing of it is on the meta device).
        Raises on every rank alike (every rank built the same module) what cannot be materialized."""
        if not has_meta_tensors(module):
            return None
        plans = [construction_targets(module, record) for record in self.records]
        known = {name for plan in plans for targets in plan.by_storage.values() for name in (t.name for t in targets)}
        unknown = sorted({name for plan in plans for name in plan.unknown} - known)
        if unknown:
            raise HybridConfigError(
                f"{type(module).__name__} holds tensors on the meta device that HybridStrategy did not see being"
                f" built: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}. HybridStrategy builds what"
                " `configure_model` (or `trainer.init_module()`) creates on the meta device and initializes each"
                " rank's shards as one device would; tensors made on meta elsewhere have no values to give. Build"
                " them inside `configure_model` without a device of your own, or give weights with"
                " `pretrained_weights`."
            )
        if pipeline_partition == "profile":
            raise HybridConfigError(
                "`pipeline_partition='profile'` times each block on one rank, but the model was built on the meta"
                " device (in `configure_model` or `trainer.init_module()`), where no block can run before it is"
                " split. Use `pipeline_partition='parameters'` (blocks balanced by parameter count), `'uniform'` or"
                " a list of block counts."
            )
        return [plan for plan in plans if plan.by_storage]

    def materialize(
        self,
        module: nn.Module,
        plans: list[ConstructionTargets],
        device: torch.device,
        *,
        unsplit_copy: object = None,
        weights_follow: bool = False,
    ) -> None:
        """Give ``module`` (split and sharded) its local shards with one device's values; an unsplit copy made for
        the first-step check gets storage only (it loads the split model's weights before it runs).
        ``weights_follow``: pretrained weights fill the model next, so a weight its construction never initialized
        is no error."""
        self.peak_bytes = 0
        uninitialized: list[str] = []
        for plan in plans:
            report = materialize(module, plan, device)
            self.peak_bytes = max(self.peak_bytes, report.peak_bytes)
            uninitialized += [plan.name_of(key) for key in sorted(report.uninitialized)]
        allocate(module, device)  # what no record made (nothing, once plan() passed), and tensors the split added
        if isinstance(unsplit_copy, nn.Module):
            allocate(unsplit_copy, device)
        self.records.clear()  # the log holds every storage's meta tensor: let it go
        if uninitialized and not weights_follow:
            raise HybridConfigError(
                f"{uninitialized[:5]}{' ...' if len(uninitialized) > 5 else ''} of {type(module).__name__} are never"
                " initialized in its construction (made with `torch.empty` and not written): on one device they"
                " would hold whatever memory held. Initialize them where they are built (`nn.init.*`,"
                " `reset_parameters`) or load weights with `pretrained_weights`."
            )
