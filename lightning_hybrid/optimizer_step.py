"""One training step, in order: the step spine.

Lightning enters a training step through the strategy's ``optimizer_step`` (automatic optimization: its closure runs
the step and its backward; manual optimization: ``optimizer.step()`` in the module's step). :meth:`OptimizerStep.run`
spells out everything that follows, top to bottom:

1. run the step, pipelined or not (Lightning's closure: ``strategy.training_step`` -> ``module_step.run_step``);
2. restore: the pipeline's schedule ran the backward inside the step, its gradients go back on the parameters
   (Lightning's closure: ``strategy.backward``);
3. reduce: tensor-parallel replicas, tied weights across stages, then the data-parallel (ZeRO) reduction;
4. unscale and agree on overflow on every rank (fp16);
5. the global norm (when tracked; clipping takes it anyway);
6. clip by the global norm (Lightning's ``on_before_optimizer_step`` hooks and ``configure_gradient_clipping``);
7. step, or skip on every rank if any rank overflowed;
8. gather the updated shards back into the parameters (ZeRO-1/2), or drop the overflowed gradients.

What the step learns on the way travels as one :class:`~lightning_hybrid.precision.plugin.OptimizerStepState`,
created per step, handed to the precision plugin and kept as the last step (``last``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor, nn

from lightning_hybrid._lightning_compat import unwrap_optimizer
from lightning_hybrid.monitoring.gradients import grad_norm_error, raised_in_lightning_grad_norm
from lightning_hybrid.precision.plugin import HybridPrecision, OptimizerStepState
from lightning_hybrid.sharding.gradient_step import GradientStep

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["OptimizerStep", "pipelined_backward", "spine_hook"]


class OptimizerStep:
    """Runs every optimizer step of one fit through :meth:`run` (the strategy builds one after
    ``configure_optimizers``) and keeps the last step's :class:`OptimizerStepState`.

    Arguments:
        gradients: the fit's :class:`~lightning_hybrid.sharding.gradient_step.GradientStep`.
        precision: the strategy's :class:`~lightning_hybrid.HybridPrecision` (loss scaler, hooks, skipped steps).

    Example:
        >>> # spine = OptimizerStep(GradientStep.for_layout(...), plugin)
        >>> # strategy.optimizer_step: spine.run(optimizer, closure, module, backward_sync_blocked=False,
        >>> #                                    track_norm=False)   # collective, all ranks
    """

    def __init__(self, gradients: GradientStep, precision: HybridPrecision) -> None:
        self.gradients, self.precision = gradients, precision
        self.last = OptimizerStepState()
        """The current optimizer step, or the last one between steps."""
        self._inside_step = False
        self._reduced_ahead: Optional[tuple[Any, OptimizerStepState]] = None
        """(optimizer, its step's state) whose gradients a manual step's clipping reduced before the step."""
        precision.clip_by_global_norm_with(self.clip_optimizer, self.gradients_for_clipping)

    def run(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule,
        *,
        backward_sync_blocked: bool,
        track_norm: bool,
        **kwargs: Any,
    ) -> Any:
        """One optimizer step of ``optimizer`` (``kwargs``: for ``optimizer.step``); returns what the closure did.
        Collective: every rank runs it for every optimizer step."""
        gradients, precision = self.gradients, self.precision
        sharded = gradients.sharded_for(optimizer)
        buckets = sharded.buckets if sharded is not None else None
        # a manual step's clipping may have reduced this optimizer's gradients already (gradients_for_clipping)
        ahead, self._reduced_ahead = self._reduced_ahead, None
        reduced_ahead = ahead is not None and ahead[0] is unwrap_optimizer(optimizer)
        # until this step takes or clips a norm, the last one is still the one to report
        state = self.last = ahead[1] if reduced_ahead else OptimizerStepState(norm=self.last.norm)

        def step_and_its_gradients() -> Any:
            # the precision plugin calls this first inside the optimizer step (torch's optimizer may call it for it)
            if buckets is not None and not backward_sync_blocked:
                buckets.arm()  # this closure's backward is the step's last: reduce buckets as it goes
            # 1. and 2. Lightning's closure: strategy.training_step (module_step.run_step: the pipeline's schedule
            # runs forward and backward, or the module's own step), then strategy.backward (the schedule's gradients
            # restored, or autograd's backward)
            result = closure()
            if reduced_ahead:
                return result
            # 3. and 4. reduce, unscale and agree on overflow
            self._reduce_and_unscale(sharded, state)
            # 5. the global norm: a pass over the gradients and a scalar all-reduce, only when asked
            state.norm = state.taken_norm = gradients.norm.total() if track_norm and not state.found_inf else None
            return result

        self._inside_step = True
        try:
            # 6. and 7. the precision plugin runs the closure above, Lightning's on_before_optimizer_step hooks and
            # gradient clipping (HybridPrecision.clip_grad_by_norm -> self.clip), then this rank's optimizer step,
            # skipped on every rank if state.found_inf
            output = precision.optimizer_step(optimizer, model, step_and_its_gradients, state, **kwargs)
        except RuntimeError as error:
            if raised_in_lightning_grad_norm(error):  # reached through code the set-up check does not read
                raise grad_norm_error("`on_before_optimizer_step` (or a function it calls)") from error
            raise
        finally:
            state.taken_norm = None  # clipping after the step measures the gradients as they are then
            self._inside_step = False
        gradients.measure_model_state(state.found_inf)
        # 8. gather the updated shards into the parameters; after an overflow, weights and optimizer state stay as
        # they were and the overflowed gradients go
        if state.found_inf:
            if sharded is not None:
                sharded.discard_gradients()
            for p in gradients.module.parameters():
                p.grad = None
        elif sharded is not None:
            sharded.gather_parameters()
        return output

    def _reduce_and_unscale(self, sharded: Any, state: OptimizerStepState) -> None:
        """Steps 3 and 4 of :meth:`run`, for the gradients ``sharded`` (or the whole model's) steps on."""
        # 3. reduce: TP replicas and tied weights summed, then the data-parallel average into the ZeRO shards
        self.gradients.reduce(sharded)
        # 4. unscale and agree on overflow, world-wide (fp16 only)
        if self.precision.scaler is not None:
            state.found_inf = self.precision.unscale_gradients_(self.gradients.norm.gradients(), self.gradients.device)

    def gradients_for_clipping(self, optimizer: Any) -> OptimizerStepState:
        """The state of the step whose gradients are about to be clipped, with them reduced. Inside a step (automatic
        optimization) they are already. Manual optimization clips between ``manual_backward`` and
        ``optimizer.step()``, where ``"ddp"``'s gradients are already averaged: ``optimizer``'s are reduced (and
        unscaled) now, and not again in its step. Collective: every rank clips alike."""
        if self._inside_step:
            return self.last
        if self._reduced_ahead is None or self._reduced_ahead[0] is not unwrap_optimizer(optimizer):
            state = self.last = OptimizerStepState(norm=self.last.norm)
            self._reduce_and_unscale(self.gradients.sharded_for(optimizer), state)
            self._reduced_ahead = (unwrap_optimizer(optimizer), state)
        return self._reduced_ahead[1]

    def clip_optimizer(self, optimizer: Any, max_norm: float) -> Optional[float]:
        """Lightning's gradient clipping by norm (``configure_gradient_clipping``, ``self.clip_gradients``); returns
        the norm before clipping, None when the step overflowed (it is skipped; that norm means nothing). Inside a
        step every gradient is clipped by the global norm (:meth:`clip`); in a manual step, ``optimizer``'s own
        parameters by their own norm, as Lightning's plugin clips them."""
        state = self.gradients_for_clipping(optimizer)
        if state.found_inf:
            return None
        if self._inside_step:
            return self.clip(max_norm)
        sharded = self.gradients.sharded_for(optimizer)
        only = (
            None
            if sharded is not None
            else {id(p) for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]}
        )
        state.norm = self.gradients.norm.clip_(max_norm, sharded=sharded, parameters=only)
        return state.norm

    def clip(self, max_norm: float) -> float:
        """Clip every gradient by the norm over all shards (TP, PP, ZeRO), counting each element once, as on one
        device; returns that norm (before clipping). Collective: all ranks call it (Lightning does, per step)."""
        state = self.last
        # inside a step the norm was just taken (after the reduction and unscaling): clipping reuses it
        state.norm = self.gradients.norm.clip_(max_norm, norm=state.taken_norm)
        return state.norm

    def hold_schedulers_on_skipped_steps(self, trainer: pl.Trainer) -> None:
        """A step skipped for gradient overflow must not advance per-step LR schedulers (as in Megatron). Lightning
        steps them through the module's ``lr_scheduler_step`` hook after every optimizer step, so the hook is
        wrapped (on this module instance, until :meth:`release_schedulers`) to pass over them after a skipped step."""
        if self.precision.scaler is None or not trainer.lr_scheduler_configs:
            return
        per_step = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        module = self.gradients.module
        hook = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if self.last.found_inf and id(scheduler) in per_step:
                return
            hook(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    @staticmethod
    def release_schedulers(module: nn.Module) -> None:
        """Undo :meth:`hold_schedulers_on_skipped_steps` (at teardown)."""
        module.__dict__.pop("lr_scheduler_step", None)


def pipelined_backward(strategy: Any, runner: Any, closure_loss: Tensor) -> Tensor:
    """Step 2 of :meth:`OptimizerStep.run` under a pipeline, as the strategy's ``backward``: the schedule ran forward
    and backward inside ``training_step``, so ``runner`` (the :class:`~lightning_hybrid.pipeline.PipelineRunner`) puts
    its gradients back on the parameters where autograd's backward would run, between Lightning's backward hooks in
    ``Strategy.backward``'s order."""
    module, precision = strategy.lightning_module, strategy.precision_plugin
    strategy.pre_backward(closure_loss)
    closure_loss = precision.pre_backward(closure_loss, module)
    runner.restore_gradients()
    closure_loss = precision.post_backward(closure_loss, module)
    strategy.post_backward(closure_loss)
    return closure_loss


def spine_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """The strategy's public method answered by ``method`` of the fit's :class:`OptimizerStep` it owns
    (``strategy._optimizer_step``), or of that step's :class:`~lightning_hybrid.sharding.gradient_step.GradientStep`
    for a method of that class; with the method's signature and docstring. One line each in the strategy, as its step
    and checkpoint hooks are. The optimizers must be set up.

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> HybridStrategy.full_gradients.__doc__ == GradientStep.full_gradients.__doc__
        True
    """
    of_gradients = getattr(GradientStep, method.__name__, None) is method

    @functools.wraps(method)
    def hook(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        spine = strategy._optimizer_step
        assert spine is not None, "set up the optimizers first"
        return method(spine.gradients if of_gradients else spine, *args, **kwargs)

    return hook
