"""One optimizer step's gradients, in order: reduce, unscale, agree on overflow, global norm, clip, step or skip,
gather the parameters.

The strategy builds one :class:`GradientStep` per fit (after ``configure_optimizers``) and runs every optimizer step
through it; the precision plugin is handed it for clipping by the global norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._lightning_compat import unwrap_optimizer
from lightning_hybrid.sharding.memory import measure_model_state_bytes
from lightning_hybrid.sharding.norm import GradientNorm
from lightning_hybrid.sharding.zero import GradientSync, ShardedOptimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_hybrid.config import ParallelLayout
    from lightning_hybrid.parallelize import Parallelized

__all__ = ["GradientStep", "GradientStepHooks"]


class GradientStep:
    """The gradients of every optimizer step: made the single-device ones, unscaled, measured, clipped, stepped.

    Arguments:
        module: the parallelized LightningModule.
        optimizers: the strategy's optimizers (``LightningOptimizer`` or plain).
        mesh: the ``("pipeline", "data", "tensor")`` mesh.
        zero_stage: 0-3; below 3 each optimizer is wrapped in a :class:`ShardedOptimizer` (FSDP2 reduces ZeRO-3).
        precision: the :class:`~lightning_hybrid.HybridPrecision` plugin (loss scale, master dtype, overflow flag).
        device: this rank's device (the overflow flag's all-reduce runs there).
        gradient_sync: the tensor-parallel (and ZeRO-3 left-out) gradient sum of the parallelized model.
        tied_sync: the sum over pipeline stages of parameters several stages hold (None without such).
        duplicates: parameters another stage also holds, counted once in the norm.
        bucket_cap_mb: reduce gradients in buckets of this size during backward (None: after the last backward).
        offload: step the optimizers on the host with DeepSpeedCPUAdam (``offload_optimizer``).

    Example:
        >>> # step = GradientStep(module, strategy.optimizers, mesh=mesh, zero_stage=1, precision=plugin, ...)
        >>> # strategy.optimizer_step: step.run(optimizer, closure, run_optimizer)   # collective, all ranks
    """

    def __init__(
        self,
        module: pl.LightningModule,
        optimizers: list[Any],
        *,
        mesh: DeviceMesh,
        zero_stage: int,
        precision: Any,
        device: torch.device,
        gradient_sync: Optional[GradientSync],
        tied_sync: Optional[Callable[[], None]],
        duplicates: list[nn.Parameter],
        bucket_cap_mb: Optional[float],
        offload: bool,
    ) -> None:
        self.module, self.optimizers, self.precision, self.device = module, optimizers, precision, device
        self.gradient_sync, self.tied_sync = gradient_sync, tied_sync
        self.sharded: list[ShardedOptimizer] = (
            [
                ShardedOptimizer(
                    unwrap_optimizer(opt),
                    stage=zero_stage,
                    dp_mesh=mesh["data"],
                    master_dtype=precision.master_dtype,
                    bucket_cap_mb=bucket_cap_mb,
                    tensor_sync=gradient_sync,  # ZeRO-2 buckets apply it per bucket, before reducing
                    parameter_order=list(module.parameters()),  # reversed: the order of backward
                    host_masters=offload,
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

            self.offloads = attach_offload(optimizers, [self.sharded_for(o) for o in optimizers])
        self._inside_step = False
        self._reduced_ahead: Optional[Any] = None
        """The optimizer whose gradients :meth:`before_clipping` reduced ahead of its step (manual optimization)."""
        self.last_norm: Optional[float] = None
        """The global gradient norm before clipping at the last optimizer step (None if not taken or overflowed)."""
        self._step_norm: Optional[float] = None
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
            precision=precision,
            device=device,
            gradient_sync=parallelized.gradient_sync,
            tied_sync=parallelized.tied_sync,
            duplicates=parallelized.duplicates,
            bucket_cap_mb=zero.bucket_cap_mb if overlap else None,
            offload=zero.offload_optimizer,
        )

    def close(self) -> None:
        """Stop the gradient buckets listening to backward (a later fit builds a new step)."""
        for z in self.sharded:
            if z.buckets is not None:
                z.buckets.remove_hooks()

    def sharded_for(self, optimizer: Any) -> Optional[ShardedOptimizer]:
        """The ZeRO wrapper of ``optimizer`` (None at ZeRO-3)."""
        raw = unwrap_optimizer(optimizer)
        return next((z for z in self.sharded if z.optimizer is raw), None)

    # ------------------------------------------------------------------ the step
    def run(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        *,
        backward_sync_blocked: bool,
        track_norm: bool,
    ) -> Any:
        """One optimizer step: ``step(closure_then_reduce)`` is Lightning's (precision plugin's) optimizer step,
        skipped on every rank if any rank's gradients overflowed; afterwards the parameters are gathered (ZeRO)."""
        sharded = self.sharded_for(optimizer)
        plugin = self.precision
        reduced_ahead = self._reduced_ahead is unwrap_optimizer(optimizer)

        def closure_then_reduce() -> Any:
            buckets = sharded.buckets if sharded is not None else None
            if buckets is not None and not backward_sync_blocked:
                buckets.arm()  # this closure's backward pass is the step's last: reduce buckets as it goes
            result = closure()
            if not reduced_ahead:
                self._prepare(sharded, track_norm)
            return result

        self._inside_step = True
        try:
            output = step(closure_then_reduce)
        finally:
            self._step_norm, self._reduced_ahead, self._inside_step = None, None, False
        self._measure_model_state()
        if plugin.found_inf:
            # weights and optimizer state stay as they were; the overflowed gradients go
            if sharded is not None:
                sharded.discard_gradients()
            for p in self.module.parameters():
                p.grad = None
        elif sharded is not None:
            sharded.gather_parameters()
        return output

    @property
    def inside_step(self) -> bool:
        """Whether an optimizer step is running (Lightning's clipping there follows the reduction)."""
        return self._inside_step

    def _prepare(self, sharded: Optional[ShardedOptimizer], track_norm: bool) -> None:
        """The order on the gradients an optimizer steps on: reduce, unscale (fp16), agree on overflow world-wide,
        global norm; Lightning's hooks and clipping follow, then the step (skipped on every rank on overflow)."""
        self.reduce(sharded)
        plugin = self.precision
        found_inf = plugin.scaler is not None and plugin.unscale_gradients_(self.norm.gradients(), self.device)
        # one pass over the gradients and a scalar all-reduce: only when asked (clipping takes it anyway)
        tracked = track_norm and not found_inf
        self.last_norm = self._step_norm = self.norm.total() if tracked else None

    def before_clipping(self, optimizer: Any) -> None:
        """Manual optimization clips between ``manual_backward`` and ``optimizer.step()``, where ``"ddp"``'s gradients
        are already averaged: reduce (and unscale) ``optimizer``'s gradients now, and not again in its step. Inside a
        step (automatic optimization) they are reduced already. Collective: every rank clips alike."""
        raw = unwrap_optimizer(optimizer)
        if self._inside_step or self._reduced_ahead is raw:
            return
        self._prepare(self.sharded_for(optimizer), track_norm=False)
        self._reduced_ahead = raw

    def _measure_model_state(self) -> None:
        if self._model_state_settled:
            return
        # sizes settle once every state tensor exists (after the first real step): stop measuring then
        measured = measure_model_state_bytes(self.module, self.optimizers, self.sharded or None)
        if self.offloads:
            from lightning_hybrid.sharding.offload import offload_ledger

            measured = offload_ledger(measured, self.offloads)
        self._model_state_settled = measured == self.model_state_bytes and not self.precision.found_inf
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

    def clip_(self, max_norm: float) -> float:
        """Clip every gradient by the norm over all shards (TP, PP, ZeRO), counting each element once, as on one
        device; returns that norm (before clipping). Collective: all ranks call it (Lightning does, per step)."""
        # inside a step the norm was just taken (after the reduction and unscaling): clipping reuses it
        self.last_norm = self.norm.clip_(max_norm, norm=self._step_norm)
        return self.last_norm

    def clip_optimizer_(self, optimizer: Any, max_norm: float) -> float:
        """Clip ``optimizer``'s gradients by their global norm (manual optimization's ``self.clip_gradients``, where
        each optimizer clips its own parameters' gradients, as Lightning's plugin does); returns that norm."""
        self.before_clipping(optimizer)
        sharded = self.sharded_for(optimizer)
        raw = unwrap_optimizer(optimizer)
        only = {id(p) for group in raw.param_groups for p in group["params"]} if sharded is None else None
        self.last_norm = self.norm.clip_(max_norm, sharded=sharded, parameters=only)
        return self.last_norm

    def hold_schedulers_on_skipped_steps(self, trainer: pl.Trainer) -> None:
        """A step skipped for gradient overflow must not advance per-step LR schedulers (as in Megatron). Lightning
        steps them through the module's ``lr_scheduler_step`` hook after every optimizer step, so the hook is
        wrapped (on this module instance, until :meth:`release_schedulers`) to pass over them after a skipped step."""
        if self.precision.scaler is None or not trainer.lr_scheduler_configs:
            return
        per_step = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        hook = self.module.lr_scheduler_step
        plugin = self.precision

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if plugin.found_inf and id(scheduler) in per_step:
                return
            hook(scheduler, metric)

        self.module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    @staticmethod
    def release_schedulers(module: nn.Module) -> None:
        """Undo :meth:`hold_schedulers_on_skipped_steps` (at teardown)."""
        module.__dict__.pop("lr_scheduler_step", None)

    # ------------------------------------------------------------------ reading the gradients
    def full_gradients(self) -> dict[str, Tensor]:
        """Every parameter's reduced gradient as a full tensor (gathered over TP and ZeRO shards). Collective: call it
        on all ranks, between the gradient reduction and the optimizer step (e.g. ``on_before_optimizer_step``)."""
        from lightning_hybrid.checkpoint import full_tensor

        grads: dict[int, Optional[Tensor]] = {}
        for z in self.sharded:
            grads.update({id(p): g for p, g in zip(z.model_parameters, z.gathered_gradients())})
        out = {}
        for name, p in self.module.named_parameters():
            g = grads.get(id(p), p.grad)
            if g is None:
                continue
            if isinstance(p, DTensor) and not isinstance(g, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            out[name] = full_tensor(g)  # fused projections too, on every torch of the supported range
        return out

    def bucket_stats(self) -> list[list[dict[str, int]]]:
        """Per optimizer, per gradient bucket: parameters, bytes, all-reduces started and how many of them started
        during backward (empty lists where the gradients are not bucketed)."""
        return [z.buckets.stats() if z.buckets is not None else [] for z in self.sharded]


class GradientStepHooks:
    """The gradient half of :class:`~lightning_hybrid.HybridStrategy`'s public API, as a mixin: each member reads
    the strategy's :class:`GradientStep` (``_gradient_step``, built by ``setup_optimizers``).

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> HybridStrategy(zero_stage=1).last_gradient_norm is None  # no optimizer step yet
        True
    """

    _gradient_step: Optional[GradientStep]

    def _require_step(self) -> GradientStep:
        assert self._gradient_step is not None, "set up the optimizers first"
        return self._gradient_step

    @property
    def gradient_buckets(self) -> list[list[dict[str, int]]]:
        """Per optimizer, per gradient bucket (``overlap_grad_reduce``): parameters, bytes, all-reduces started and
        how many of them started during backward (empty lists where the gradients are not bucketed)."""
        return self._gradient_step.bucket_stats() if self._gradient_step is not None else []

    @property
    def last_gradient_norm(self) -> Optional[float]:
        """The global gradient norm before clipping at the last optimizer step (None if it overflowed)."""
        return self._gradient_step.last_norm if self._gradient_step is not None else None

    @property
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank held at the last optimizer step."""
        return self._gradient_step.model_state_bytes if self._gradient_step is not None else {}

    @property
    def sharded_optimizers(self) -> list[ShardedOptimizer]:
        """The ZeRO-0/1/2 wrappers of the optimizers (none at ZeRO-3 or before the optimizers are set up)."""
        return self._gradient_step.sharded if self._gradient_step is not None else []

    def _sharded_for(self, optimizer: Any) -> Optional[ShardedOptimizer]:
        return self._gradient_step.sharded_for(optimizer) if self._gradient_step is not None else None

    def clip_gradients_by_global_norm(self, max_norm: float) -> float:
        """Clip every gradient by the norm over all shards (TP, PP, ZeRO), counting each element once, as on one
        device; returns that norm (before clipping). Collective: all ranks call it (Lightning does, per step)."""
        return self._require_step().clip_(max_norm)

    def reduce_gradients(self, sharded: Optional[ShardedOptimizer] = None) -> None:
        """Make gradients the single-device ones: tensor-parallel replicas first, then data-parallel (ZeRO) reduction.
        Runs once per optimizer step, after all gradient accumulation (FSDP2 reduces ZeRO-3 gradients itself)."""
        self._require_step().reduce(sharded)

    def full_gradients(self) -> dict[str, Tensor]:
        """Every parameter's reduced gradient as a full tensor (gathered over TP and ZeRO shards). Collective: call it
        on all ranks, between the gradient reduction and the optimizer step (e.g. ``on_before_optimizer_step``)."""
        return self._require_step().full_gradients()
