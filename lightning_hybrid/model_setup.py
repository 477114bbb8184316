"""A module made ready to train, once per module: split and sharded (:func:`~lightning_hybrid.parallelize.parallelize`),
given memory for its own shards when it was built on the meta device (``construction/``), filled from pretrained
weights, and its first-step check, metrics and model summary told what the split means. ``HybridStrategy.setup``
calls :func:`set_up_module` (Lightning calls ``setup`` again for each entry point on the same module: the strategy
keeps which module it split).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import nn

from lightning_hybrid.checkpoint.pretrained import LoadReport, load_pretrained_weights
from lightning_hybrid.construction.deferred import DeferredConstruction
from lightning_hybrid.monitoring.metrics import sync_metrics_over
from lightning_hybrid.monitoring.summary import summarize_whole_model
from lightning_hybrid.parallelize import ModelOptions, Parallelized, parallelize
from lightning_hybrid.topology import Topology

__all__ = ["set_up_module"]


def set_up_module(
    module: nn.Module,
    topology: Topology,
    options: ModelOptions,
    precision: Any,
    *,
    deferred: DeferredConstruction,
    pretrained_weights: Optional[str],
    callbacks: list[Any],
    reduce_gradients: Callable[[], None],
) -> tuple[Parallelized, Optional[LoadReport]]:
    """Split ``module`` over ``topology``'s mesh, in this order: :func:`~lightning_hybrid.parallelize.parallelize`;
    the recorded construction replayed for this rank's shards (when built on meta); ``pretrained_weights`` read into
    them; the first-step check's gradient sum (``reduce_gradients``: the strategy's, once the optimizers exist),
    torchmetrics' reduction over the data-parallel replicas and, under a pipeline, Lightning's model summary of the
    whole model (``callbacks``). Returns what ``parallelize`` made and what was loaded on this rank.

    Example:
        >>> # parallelized, pretrained = set_up_module(module, topology, options, precision, deferred=deferred,
        >>> #     pretrained_weights=None, callbacks=trainer.callbacks, reduce_gradients=strategy.reduce_gradients)
    """
    layout = topology.layout
    plans = deferred.plan(module, pipeline_partition=layout.pipeline.partition)
    parallelized = parallelize(module, layout, topology.mesh, options, precision, topology.expert_mesh,
                               topology.context_mesh)  # fmt: skip
    runner, verifier = parallelized.runner, parallelized.verifier
    if plans is not None:  # built on meta: only now, split, does this rank get memory for its shards
        unsplit_copy = getattr(verifier, "reference", None)
        follow = pretrained_weights is not None
        deferred.materialize(module, plans, options.device, unsplit_copy=unsplit_copy, weights_follow=follow)
    # the split model's own shards are filled from pretrained weights, before the optimizers (and ZeRO's fp32 masters)
    # are made from them; a later ckpt_path resume overwrites them (checkpoint/pretrained.py)
    pretrained = load_pretrained_weights(module, pretrained_weights, parallelized)
    if verifier is not None:
        # the check's gradients are summed within a replica: over the stages' tied weights and tensor-parallel replicas
        # (verify_pipeline), or the tensor-parallel sums only, since ZeRO's reduction keeps state of its own that the
        # check's dropped gradients must not reach (verify_tensor_parallel)
        verifier.sync = reduce_gradients if runner is not None else parallelized.gradient_sync
    sync_metrics_over(module, topology.data_group)  # torchmetrics: reduce over replicas only
    if runner is not None:  # Lightning's ModelSummary: one device's counts, not this rank's stages
        summarize_whole_model(callbacks, module, runner.network, runner.split.unsplit)
    return parallelized, pretrained
