"""How the strategy's step hooks run the LightningModule's steps, and what a step gives Lightning.

A step runs under the precision plugin's context for it; under pipeline parallel, through the pipeline runner, which
gives back the step's output and the values it logged, merged over micro-batches
(:class:`~lightning_hybrid.pipeline.step_data.StepResults`). A vocabulary-parallel head's logits reach the step as
tensors that behave as the whole logits (``tensor_parallel/vocab.py``): no context is needed around the step or its
backward. Lightning then receives plain tensors (not DTensors, nor split logits), and
``self.log(..., sync_dist=True)`` reduces over the data-parallel replicas
only: tensor and pipeline peers of a replica hold the same value, so reducing over them too would count it several
times. Both ways of logging name that group with :func:`sync_over`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.data import check_replica_batches
from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.monitoring.gradients import check_gradient_norm_hooks
from lightning_hybrid.pipeline.logged import REDUCTIONS
from lightning_hybrid.tensor_parallel.vocab import whole_logits

if TYPE_CHECKING:
    from lightning_hybrid.parallelize import Parallelized

__all__ = [
    "STEP_CONTEXTS",
    "check_before_fit",
    "check_manual_optimization",
    "check_weight_averaging",
    "context_reduced",
    "plain",
    "plain_logging",
    "run_step",
    "step_hook",
    "sync_over",
]

STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}
"""The precision plugin's context for each step (autocast / default dtype), as Lightning's own strategies use them."""


def step_hook(name: str) -> Callable[..., Any]:
    """The strategy's hook ``name`` (``training_step``, ...): the module's step, run by :func:`run_step`. The first
    training batch of a fit is checked to be the same on a replica's tensor and pipeline ranks."""

    def step(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "training_step" and strategy._first_batch_unchecked:
            strategy._first_batch_unchecked = False
            check_replica_batches(args[0], strategy.device_mesh, strategy.root_device)
        module, plugin, parallelized = strategy.lightning_module, strategy.precision_plugin, strategy.parallelized
        context_group = strategy._topology.context_group if strategy._topology is not None else None
        return run_step(module, name, args, kwargs, plugin, parallelized, strategy._data_group, context_group)

    step.__name__ = step.__qualname__ = name
    return step


def check_before_fit(module: Any, layout: Any) -> None:
    """What the layout cannot train as ``"ddp"`` would, refused on every rank before any process group exists."""
    check_manual_optimization(module, layout.pipeline_parallel_size)
    trainer = getattr(module, "_trainer", None)
    check_weight_averaging(trainer, layout)
    if trainer is not None and trainer.state.fn == "fit":
        # the "-true" precisions step fp32 masters, which hold the reduced gradients (p.grad is None)
        master_weights = getattr(trainer.precision_plugin, "precision", "32-true") in ("bf16-true", "16-true")
        check_gradient_norm_hooks(module, layout, master_weights)


def check_manual_optimization(module: Any, pipeline_parallel_size: int) -> None:
    """Refuse, on every rank before any process group exists, a manual-optimization fit under a pipeline."""
    trainer = getattr(module, "_trainer", None)
    fitting = trainer is not None and trainer.state.fn == "fit"
    if pipeline_parallel_size > 1 and not module.automatic_optimization and fitting:
        raise HybridConfigError(
            f"Manual optimization (`automatic_optimization=False` in {type(module).__name__}) cannot be pipelined"
            f" (`pipeline_parallel_size={pipeline_parallel_size}`): the schedule runs each micro-batch's"
            " backward itself, where the step calls `manual_backward` and the optimizers. Use"
            ' `pipeline_parallel_size=1` (tensor and data parallel train manual steps as `"ddp"` does).'
        )


def check_weight_averaging(trainer: Any, layout: Any) -> None:
    """Refuse, on every rank before any process group exists, Lightning's ``StochasticWeightAveraging`` where a rank
    does not hold every parameter whole: it deep-copies the module before the strategy splits it, then pairs that
    copy's parameters with the split module's one by one (a ZeRO-3 or tensor-parallel shard, or one stage's list)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if trainer is None or not any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks):
        return
    split = {
        "tensor_parallel_size": layout.tensor_parallel_size,
        "pipeline_parallel_size": layout.pipeline_parallel_size,
        "expert_parallel_size": layout.expert_parallel_size,
    }
    named = [f"`{name}={value}`" for name, value in split.items() if value > 1]
    if layout.zero_stage == 3 and layout.data_parallel_size > 1:
        named.append("`zero_stage=3`")
    if named:
        raise HybridConfigError(
            f"StochasticWeightAveraging cannot average a split model ({', '.join(named)}): it copies the module"
            " before the strategy splits it and pairs the copy's parameters with this rank's shards and stages."
            " Use data parallel alone at `zero_stage` 0, 1 or 2 (every rank holds every parameter whole), or"
            " average the weights yourself in a callback through `trainer.strategy` (docs/lightning-features.md)."
        )


def run_step(
    module: Any,
    name: str,
    args: tuple,
    kwargs: dict,
    precision: Any,
    parallelized: Optional[Parallelized],
    data_group: Any,
    context_group: Any = None,
) -> Any:
    """Run ``module``'s step ``name`` (``"training_step"``, ...) as the strategy's hook of that name does, and return
    its output with plain tensors (``parallelized``: what the module was parallelized into; None before that;
    ``context_group``: the context-parallel ranks of this replica, whose logged values are reduced over them).

    Example:
        >>> # output = run_step(module, "training_step", (batch, 0), {}, plugin, strategy.parallelized, data_group)
    """
    runner = parallelized.runner if parallelized is not None else None
    with getattr(precision, STEP_CONTEXTS[name])():
        if runner is not None:
            # the schedule runs backward inside the step: the fp16 loss scale is applied there, and so is Lightning's
            # division of the loss by accumulate_grad_batches, which it applies to the loss it differentiates itself
            loss_scale = (precision.loss_scale or 1.0) / _accumulation(module, name)
            results = runner.run(name, *args, *kwargs.values(), loss_scale=loss_scale)
            # what the step logged, merged over micro-batches: Lightning's log once per name, on every rank; pipeline
            # and tensor peers hold the same value, so `sync_dist` reduces over the data-parallel replicas only
            return results.log(
                lambda key, value, *a, **kw: module.log(
                    key, context_reduced(value, kw, context_group), *a, **sync_over(kw, data_group)
                )
            )
        explained = parallelized.explained_failures if parallelized is not None else lambda _: nullcontext()
        checked: AbstractContextManager = nullcontext()
        if name == "training_step" and parallelized is not None and parallelized.first_step_unchecked:
            # context parallel's probe of the loss before the step; verify_tensor_parallel at its network call
            checked = parallelized.first_step_checked(module, name, args, kwargs)
        with plain_logging(module, data_group, context_group), explained(module), checked:
            output = getattr(module, name)(*args, **kwargs)
    return plain(output)


def _accumulation(module: Any, name: str) -> int:
    """What Lightning divides a training step's loss by before its backward (automatic optimization), else 1."""
    trainer = getattr(module, "_trainer", None)
    if name != "training_step" or trainer is None or not module.automatic_optimization:
        return 1
    return trainer.accumulate_grad_batches


def plain(value: Any) -> Any:
    """``value`` (a tensor or a collection of them) with every DTensor and every vocabulary-split logits tensor made a
    plain tensor (what a step returns leaves the step whole: Lightning's predictions, a callback's ``outputs``).

    Example:
        >>> plain({"loss": 1.0})
        {'loss': 1.0}
    """
    return whole_logits(apply_to_collection(value, DTensor, to_plain))


def sync_over(log_kwargs: dict[str, Any], group: Any) -> dict[str, Any]:
    """``self.log``'s keyword arguments, where ``sync_dist=True`` names no group of its own, with
    ``sync_dist_group=group`` (the data-parallel group; None leaves them as they are).

    Example:
        >>> sync_over({"sync_dist": True}, "data")
        {'sync_dist': True, 'sync_dist_group': 'data'}
    """
    if group is not None and log_kwargs.get("sync_dist") and log_kwargs.get("sync_dist_group") is None:
        return {**log_kwargs, "sync_dist_group": group}
    return log_kwargs


def context_reduced(value: Any, log_kwargs: dict[str, Any], group: Any) -> Any:
    """A value a step logs, reduced over the context-parallel ranks of its replica with its ``reduce_fx`` (mean by
    default): together they hold one replica's batch, each a part of its sequence, so each rank's own value is a
    part's (a mean over the part's tokens, equal in number on every rank: their mean is the batch's; a count logged
    with ``reduce_fx="sum"``: their sum). Every context rank logs the same names in the same order (one all-reduce per
    value). A torchmetrics object is left as it is (its state is reduced over replicas x context ranks when computed).
    ``group`` None (no context parallel): ``value`` unchanged.

    Example:
        >>> context_reduced(2.0, {}, None)
        2.0
    """
    if group is None or not isinstance(value, (torch.Tensor, int, float)) or isinstance(value, bool):
        return value
    reduce_fx = log_kwargs.get("reduce_fx", "mean")
    how = REDUCTIONS.get(reduce_fx) if isinstance(reduce_fx, str) or callable(reduce_fx) else None
    if how is None:
        raise HybridConfigError(
            f"`self.log(..., reduce_fx={reduce_fx!r})` under context parallel: a value each context rank computes on"
            " its part of the sequence is reduced over them, which is defined for reduce_fx 'mean', 'sum', 'max' and"
            " 'min'. Log one of those, or train without context parallel (`context_parallel_size=1`)."
        )
    tensor = plain(value).detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    tensor = tensor.to(torch.float64 if not tensor.is_floating_point() else tensor.dtype).clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if how in ("mean", "sum") else getattr(dist.ReduceOp, how.upper()),
                    group=group)  # fmt: skip
    return tensor / dist.get_world_size(group) if how == "mean" else tensor


@contextmanager
def plain_logging(module: Any, data_group: Any, context_group: Any = None) -> Generator[None, None, None]:
    """While a step runs, ``module.log`` receives plain values, reduced over ``context_group``'s ranks
    (:func:`context_reduced`), and ``sync_dist`` reduces over ``data_group`` only.

    Example:
        >>> # with plain_logging(lightning_module, mesh["data"].get_group()):
        >>> #     output = lightning_module.training_step(batch, batch_idx)
    """
    original = module.log

    @functools.wraps(original)
    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        value = context_reduced(plain(value), kwargs, context_group)
        return original(name, value, *args, **sync_over(kwargs, data_group))

    module.log = log
    try:
        yield
    finally:
        del module.log
