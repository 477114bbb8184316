"""The gradients of an optimizer step: the ZeRO wrappers of the optimizers, the reduction that makes the gradients
the single-device ones, their global norm, the gathers for reading them, and what the rank holds.

The strategy builds one :class:`GradientStep` per fit (after ``configure_optimizers``); the step spine
(``lightning_hybrid/optimizer_step.py``) calls it in the step's order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._lightning_compat import (
    lightning_optimizer,
    set_lightning_optimizers,
    unwrap_optimizer,
)
from lightning_hybrid.dtensor import full_tensor
from lightning_hybrid.expert_parallel import ExpertShards
from lightning_hybrid.sharding.flat import DataDomain
from lightning_hybrid.sharding.gradient_sync import GradientSync
from lightning_hybrid.sharding.memory import measure_model_state_bytes
from lightning_hybrid.sharding.norm import GradientNorm
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer
from lightning_hybrid.structure import state_dict_name

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_hybrid.layout import ParallelLayout
    from lightning_hybrid.parallelize import Parallelized

__all__ = ["GradientStep", "ZeroLightningOptimizer"]


class ZeroLightningOptimizer(LightningOptimizer):
    """Lightning's wrapper of an optimizer whose ZeRO wrapper steps master weights (its parameter groups hold the
    masters, not the model's parameters): its ``zero_grad`` (Lightning's loop, ``self.optimizers()[i].zero_grad()``
    in a manual step) is :meth:`ShardedOptimizer.zero_grad`, which clears the model's gradients too. Composition, as
    Lightning's own wrapper is: the user's optimizer object and its class are left as they are.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> wrapper = ZeroLightningOptimizer(optimizer)  # the strategy sets ``wrapper.zero`` to its ZeRO wrapper
        >>> isinstance(wrapper, torch.optim.SGD), type(optimizer) is torch.optim.SGD
        (True, True)
    """

    zero: Optional[ShardedOptimizer] = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.zero is None:
            unwrap_optimizer(self).zero_grad(set_to_none=set_to_none)
        else:
            self.zero.zero_grad(set_to_none=set_to_none)


class GradientStep:
    """The gradients of every optimizer step: made the single-device ones (:meth:`reduce`), measured (``norm``),
    gathered for reading (:meth:`full_gradients`); the parameters gathered back after a step (``sharded``).

    Arguments:
        module: the parallelized LightningModule.
        optimizers: the strategy's optimizers (``LightningOptimizer`` or plain).
        mesh: the ``("pipeline", "data", "tensor")`` mesh.
        zero_stage: 0-3; below 3 each optimizer is wrapped in a :class:`ShardedOptimizer` (FSDP2 reduces ZeRO-3).
        master_dtype: the dtype of the master weights ZeRO-0/1/2 step (None: the parameters' own).
        device: this rank's device (the overflow flag's all-reduce runs there).
        gradient_sync: the tensor-parallel (and ZeRO-3 left-out) gradient sum of the parallelized model.
        tied_sync: the sum over pipeline stages of parameters several stages hold (None without such).
        duplicates: parameters another stage also holds, counted once in the norm.
        bucket_cap_mb: reduce gradients in buckets of this size during backward (None: after the last backward).
        offload: step the optimizers on the host with DeepSpeedCPUAdam (``offload_optimizer``).
        experts: the expert weights under expert parallel (None without): ZeRO-0/1/2 reduce and shard them over the
            ranks holding the same experts.

    Example:
        >>> # step = GradientStep(module, strategy.optimizers, mesh=mesh, zero_stage=1, master_dtype=None, ...)
        >>> # after the step's last backward: step.reduce(step.sharded_for(optimizer))   # collective, all ranks
    """

    def __init__(
        self,
        module: pl.LightningModule,
        optimizers: list[Any],
        *,
        mesh: DeviceMesh,
        zero_stage: int,
        master_dtype: Optional[torch.dtype],
        device: torch.device,
        gradient_sync: Optional[GradientSync],
        tied_sync: Optional[Callable[[], None]],
        duplicates: list[nn.Parameter],
        bucket_cap_mb: Optional[float],
        offload: bool,
        experts: Optional[ExpertShards] = None,
    ) -> None:
        self.module, self.optimizers, self.device, self.mesh = module, optimizers, device, mesh
        self.duplicates = frozenset(id(p) for p in duplicates)
        """Parameters whose gradient another pipeline stage owns (a tied copy): left out of the norms."""
        self.gradient_sync, self.tied_sync = gradient_sync, tied_sync
        expert_ids = experts.ids if experts is not None else frozenset()
        expert_domain = None
        if experts is not None:  # the ranks holding the same experts average their gradients
            data = experts.mesh["expert_data"]
            expert_domain = DataDomain(data.get_group(), data.size(), data.get_local_rank())
        self.sharded: list[ShardedOptimizer] = (
            [
                ShardedOptimizer(
                    unwrap_optimizer(opt),
                    stage=zero_stage,
                    dp_mesh=mesh["data"],
                    master_dtype=master_dtype,
                    bucket_cap_mb=bucket_cap_mb,
                    tensor_sync=gradient_sync,  # ZeRO-2 buckets apply it per bucket, before reducing
                    parameter_order=list(module.parameters()),  # reversed: the order of backward
                    host_masters=offload,
                    expert_parameters=expert_ids,
                    expert_domain=expert_domain,
                )
                for opt in optimizers
            ]
            if zero_stage < 3
            else []
        )
        self.norm = GradientNorm(module, self.sharded, mesh, zero_stage, duplicates)
        self.offloads: list[Any] = []
        if offload:
            from lightning_hybrid.sharding.offload import attach_offload

            self.offloads = attach_offload(
                [unwrap_optimizer(o) for o in optimizers], [self.sharded_for(o) for o in optimizers]
            )
        self.model_state_bytes: dict[str, int] = {}
        """Bytes of parameters, gradients and optimizer state this rank held at the last optimizer step."""
        self._model_state_settled = False

    @classmethod
    def for_layout(
        cls,
        module: pl.LightningModule,
        optimizers: list[Any],
        layout: ParallelLayout,
        mesh: DeviceMesh,
        parallelized: Parallelized,
        precision: Any,
        device: torch.device,
    ) -> GradientStep:
        """The step of ``layout`` for the model :func:`~lightning_hybrid.parallelize.parallelize` returned.

        Example:
            >>> # step = GradientStep.for_layout(module, optimizers, layout, mesh, parallelized, plugin, device)
        """
        # the pipeline's schedule runs every micro-batch's backward inside training_step and stashes gradients
        # itself (pipeline/runner.py): it keeps the reduction after the last backward (ZeRO-2 included)
        zero = layout.zero
        overlap = zero.overlap_grad_reduce and layout.pipeline_parallel_size == 1
        return cls(
            module,
            optimizers,
            mesh=mesh,
            zero_stage=layout.zero_stage,
            master_dtype=precision.master_dtype,
            device=device,
            gradient_sync=parallelized.gradient_sync,
            tied_sync=parallelized.tied_sync,
            duplicates=parallelized.duplicates,
            bucket_cap_mb=zero.bucket_cap_mb if overlap else None,
            offload=zero.offload_optimizer,
            experts=parallelized.experts,
        )

    def wrap_lightning_optimizers(self, strategy: Any) -> None:
        """Lightning's wrappers of the strategy's optimizers, a :class:`ZeroLightningOptimizer` for each whose ZeRO
        wrapper steps masters (a plain ``LightningOptimizer`` otherwise)."""
        wrappers = []
        for optimizer in strategy.optimizers:
            zero = self.sharded_for(optimizer)
            if zero is not None and zero.uses_masters:
                wrapper = lightning_optimizer(ZeroLightningOptimizer, optimizer, strategy)
                wrapper.zero = zero
            else:
                wrapper = lightning_optimizer(LightningOptimizer, optimizer, strategy)
            wrappers.append(wrapper)
        set_lightning_optimizers(strategy, wrappers)

    def close(self) -> None:
        """Stop the gradient hooks listening to backward (the fit ended; a later fit builds a new step)."""
        for z in self.sharded:
            z.remove_hooks()

    def sharded_for(self, optimizer: Any) -> Optional[ShardedOptimizer]:
        """The ZeRO wrapper of ``optimizer`` (None at ZeRO-3)."""
        raw = unwrap_optimizer(optimizer)
        return next((z for z in self.sharded if z.optimizer is raw), None)

    def measure_model_state(self, found_inf: bool) -> None:
        """``model_state_bytes`` after an optimizer step (``found_inf``: skipped for overflow, so state may be missing);
        measured until the sizes settle."""
        if self._model_state_settled:
            return
        # sizes settle once every state tensor exists (after the first real step): stop measuring then
        measured = measure_model_state_bytes(self.module, self.optimizers, self.sharded or None)
        if self.offloads:
            from lightning_hybrid.sharding.offload import offload_ledger

            measured = offload_ledger(measured, self.offloads)
        self._model_state_settled = measured == self.model_state_bytes and not found_inf
        self.model_state_bytes = measured

    def reduce(self, sharded: Optional[ShardedOptimizer] = None) -> None:
        """Make gradients the single-device ones: tensor-parallel replicas first, then data-parallel (ZeRO) reduction.

        Runs once per optimizer step, after all gradient accumulation (FSDP2 reduces ZeRO-3 gradients itself).
        """
        for z in self.sharded:
            z.fold_gradients()  # fp32 accumulation of low-precision gradients, before any reduction reads them
        bucketed = sharded is not None and sharded.buckets is not None
        if bucketed:
            # the data-parallel average runs in buckets during backward: let it finish before the tensor-parallel
            # sync reads and writes the same gradients (both are sums over different mesh dimensions, so they
            # commute)
            sharded.reduce_gradients()
        if self.tied_sync is not None:
            self.tied_sync()
        if self.gradient_sync is not None and not (sharded is not None and sharded.reduces_in_backward):
            self.gradient_sync()
        if sharded is not None and not bucketed:
            sharded.reduce_gradients()

    # ------------------------------------------------------------------ reading the gradients
    def full_gradients(self) -> dict[str, Tensor]:
        """Every parameter's reduced gradient as a full tensor (gathered over TP and ZeRO shards). Collective: call it
        on all ranks, between the gradient reduction and the optimizer step (e.g. ``on_before_optimizer_step``)."""
        return {name: grad for name, grad in self._full_gradients(self.module)}

    def gradient_norms(self, module: nn.Module, norm_type: float = 2.0) -> dict[str, float]:
        """The ``norm_type``-norm of each reduced gradient of ``module`` (the LightningModule or a submodule of it)
        over the whole model, by its one-device name: each full gradient (gathered one parameter at a time over
        TP and ZeRO-3 shards; ZeRO-1/2 gather their flat shards), every pipeline stage's merged, a tied copy that
        another stage owns left out (one device lists a tied weight once). Collective: call it on all ranks, between
        the reduction and the optimizer step (``on_before_optimizer_step``)."""
        norms = {
            state_dict_name(name): float(grad.norm(norm_type))
            for name, grad in self._full_gradients(module, skip=self.duplicates)
        }
        pipeline = self.mesh["pipeline"]
        if pipeline.size() == 1:
            return norms
        # a rank holds its stages' parameters only: the stages' names are disjoint (a parameter every stage holds,
        # outside all blocks, has the same gradient on each after the shared sum)
        stages: list[Any] = [None] * pipeline.size()
        dist.all_gather_object(stages, norms, group=pipeline.get_group())
        return {name: value for stage in stages for name, value in stage.items()}

    def _full_gradients(self, module: nn.Module, skip: frozenset[int] = frozenset()) -> Iterator[tuple[str, Tensor]]:
        """(name, full gradient) of each parameter of ``module`` with a gradient, one at a time (collective)."""
        grads: dict[int, Optional[Tensor]] = {}
        for z in self.sharded:
            grads.update({id(p): g for p, g in zip(z.model_parameters, z.gathered_gradients())})
        for name, p in module.named_parameters():
            g = grads.get(id(p), p.grad)
            if g is None or id(p) in skip:
                continue
            if isinstance(p, DTensor) and not isinstance(g, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            yield name, full_tensor(g)  # fused projections too, on every torch of the supported range

    def bucket_stats(self) -> list[list[dict[str, int]]]:
        """Per optimizer, per gradient bucket: parameters, bytes, all-reduces started and how many of them started
        during backward (empty lists where the gradients are not bucketed)."""
        return [z.buckets.stats() if z.buckets is not None else [] for z in self.sharded]
