"""HybridPrecision: Lightning's precision plugin for HybridStrategy.

Lightning's own plugins assume one rank sees all of a parameter's gradient: their clipping norm is the rank's shard
norm, their fp16 scaler skips a step on one rank while its TP/PP peers step, and their ``-true`` modes have no fp32
master weights. Under HybridStrategy:

* ``"32-true"``: fp32 everywhere;
* ``"bf16-mixed"`` / ``"16-mixed"``: fp32 parameters, bf16/fp16 autocast;
* ``"bf16-true"`` / ``"16-true"``: bf16/fp16 parameters and activations; the optimizer steps fp32 master weights (one
  copy, sharded by ZeRO) with fp32 state, and gradients are accumulated over micro-batches in fp32;
* fp16 modes scale the loss with a :class:`~lightning_hybrid.precision.DynamicLossScaler` whose overflow check is
  agreed by every rank;
* clipping by norm uses the global norm over every TP, PP and ZeRO shard, after unscaling, before the step.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import LBFGS
from typing_extensions import override

from lightning_hybrid._lightning_compat import convert_fp_tensor, module_trainer, wrap_closure
from lightning_hybrid.config import HybridConfigError, takes_fields_of
from lightning_hybrid.dtensor import local_tensor
from lightning_hybrid.precision.loss_scaler import DynamicLossScaler, LossScalerOptions

__all__ = ["HybridPrecision", "OptimizerStepState", "PRECISIONS", "check_supported"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


@dataclass
class OptimizerStepState:
    """What one optimizer step learned about its gradients: created per step by the step spine
    (``lightning_hybrid/optimizer_step.py``), handed to :meth:`HybridPrecision.optimizer_step`, and kept as the
    strategy's last step until the next one begins.

    Example:
        >>> OptimizerStepState().found_inf
        False
    """

    found_inf: bool = False
    """Some rank's gradients overflowed (fp16): the step is skipped on every rank."""
    taken_norm: Optional[float] = None
    """The global norm the step took after unscaling (when tracked); clipping inside the step reuses it."""
    norm: Optional[float] = None
    """The global gradient norm before clipping, taken or clipped at (``strategy.last_gradient_norm``); None if
    neither, or on overflow."""


_LOW = {"bf16": torch.bfloat16, "16": torch.float16}


class HybridPrecision(Precision):
    """Precision plugin used by :class:`~lightning_hybrid.HybridStrategy` for ``Trainer(precision=...)``.

    ``Trainer(precision="16-mixed")`` (or any name in ``PRECISIONS``) picks it with default settings; pass it as a
    plugin to set the loss scaler: ``Trainer(plugins=[HybridPrecision("16-mixed", initial_scale=2**12)])``.

    Arguments:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        device: the autocast device type (``"cuda"`` or ``"cpu"``); the strategy sets it from its device.
        initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, on_min_scale: the
            dynamic loss scaler of the fp16 modes (see :class:`~lightning_hybrid.precision.DynamicLossScaler`;
            Megatron/DeepSpeed defaults). Ignored by the other modes.
        max_consecutive_skipped_steps: fp16 modes: after this many optimizer steps in a row skipped for overflow,
            end the fit cleanly (``trainer.should_stop``, as ``EarlyStopping`` does, with a warning saying why);
            weights and optimizer state are those from before the first skipped step. ``None``: keep skipping.

    Example:
        >>> import lightning as L
        >>> from lightning_hybrid import HybridPrecision, HybridStrategy
        >>> plugin = HybridPrecision("16-mixed", growth_interval=500, max_consecutive_skipped_steps=200)
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(), plugins=[plugin])
    """

    @takes_fields_of(LossScalerOptions)  # the scaler's settings, as keyword-only arguments
    def __init__(
        self,
        precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"] = "32-true",
        device: str = "cpu",
        **loss_scaler: Any,
    ) -> None:
        if precision not in PRECISIONS:
            raise HybridConfigError(
                f"`HybridPrecision(precision={precision!r})` is not supported; use one of {list(PRECISIONS)}"
                " (fp8 and 64-bit are not)."
            )
        self.precision = precision
        self.device = device
        kind, mode = precision.split("-")
        self.compute_dtype: torch.dtype = _LOW.get(kind, torch.float32)
        """The dtype matrix multiplications run in."""
        self.parameter_dtype: torch.dtype = self.compute_dtype if mode == "true" else torch.float32
        """The dtype of the model's parameters (``-true`` modes: low precision; the optimizer holds fp32 masters)."""
        self.master_dtype: Optional[torch.dtype] = torch.float32 if self.parameter_dtype != torch.float32 else None
        """The dtype of the master weights the optimizer steps, when the parameters are of lower precision."""
        # the other modes take the scaler's settings too (one configuration for every precision) and ignore them
        self.scaler: Optional[DynamicLossScaler] = DynamicLossScaler(**loss_scaler) if kind == "16" else None
        self._clip: Optional[Callable[[Any, float], Optional[float]]] = None
        self._gradients_for_clipping: Optional[Callable[[Any], OptimizerStepState]] = None
        self._step = OptimizerStepState()
        """The current optimizer step, or the last one between steps (its overflow decides whether to clip)."""

    # ------------------------------------------------------------------ metrics
    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale (None when the mode does not scale the loss)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (running count; 0 without a loss scaler)."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    # ------------------------------------------------------------------ Lightning's plugins mapped to this one
    @classmethod
    def from_lightning(cls, plugin: Optional[Precision]) -> Optional[Precision]:
        """The HybridPrecision equivalent of the plugin Lightning picked for ``Trainer(precision=...)``; other
        plugins are returned unchanged (and refused by the strategy at set-up)."""
        if plugin is None or isinstance(plugin, HybridPrecision):
            return plugin
        if type(plugin) is Precision:
            return cls("32-true")
        if type(plugin) is MixedPrecision and plugin.precision in ("bf16-mixed", "16-mixed"):
            return cls(plugin.precision, plugin.device)
        if type(plugin) is HalfPrecision:
            return cls(plugin.precision)
        return plugin

    def clip_by_global_norm_with(
        self,
        clip: Callable[[Any, float], Optional[float]],
        gradients_for_clipping: Callable[[Any], OptimizerStepState],
    ) -> None:
        """Clip by norm with ``clip(optimizer, max_norm) -> norm before clipping`` (the norm over every TP, PP and ZeRO
        shard), and before clipping by value have ``gradients_for_clipping(optimizer)`` make the gradients ready (a
        manual step clips before its reduction) and say whether the step overflowed. The plugin sits below the
        gradients in the package's layers, so it is handed only these; the strategy calls this once its optimizers
        are set up."""
        self._clip, self._gradients_for_clipping = clip, gradients_for_clipping

    # ------------------------------------------------------------------ model and data
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.parameter_dtype) if self.parameter_dtype != torch.float32 else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.parameter_dtype == torch.float32:
            return data
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.parameter_dtype)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.parameter_dtype != torch.float32:
            # tensors made inside the forward (masks, positions) take the parameters' dtype, as with HalfPrecision
            default = torch.get_default_dtype()
            torch.set_default_dtype(self.parameter_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        elif self.compute_dtype != torch.float32:
            with torch.autocast(self.device, dtype=self.compute_dtype):
                yield
        else:
            yield

    # ------------------------------------------------------------------ loss scaling
    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = tensor.float() * self.scaler.scale  # in fp32: 4.0 x 2**16 overflows fp16
        return super().pre_backward(tensor, module)

    def unscale_gradients_(self, gradients: list[Tensor], device: torch.device) -> bool:
        """Unscale the gradients the optimizer will step on and agree, world-wide, whether any overflowed.

        Called by the step spine once per optimizer step, after the gradient reduction; returns ``found_inf``.
        """
        return self.scaler.unscale_(gradients, device) if self.scaler is not None else False

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        state: Optional[OptimizerStepState] = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``closure`` (which fills ``state``: the step spine's), Lightning's hooks and clipping, then step the
        optimizer unless ``state.found_inf``."""
        self._step = state = state if state is not None else OptimizerStepState()
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise HybridConfigError("fp16 loss scaling cannot step LBFGS (its step re-evaluates the closure).")
        # the closure runs forward, backward, the reduction, the unscale and the overflow check (step spine), then
        # the hooks and clipping (_after_closure); the step itself is skipped on every rank if any rank overflowed
        closure_result = wrap_closure(self, model, optimizer, closure)
        found_inf = state.found_inf
        self.scaler.update(found_inf)
        if found_inf and self.scaler.stop_requested:
            _stop_training(model, self.scaler)
        if found_inf or (closure_result is None and model.automatic_optimization):
            return closure_result
        return optimizer.step(**kwargs)

    # ------------------------------------------------------------------ clipping
    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self._clip is None:
            raise RuntimeError("HybridPrecision clips by norm only inside HybridStrategy.")
        self._clip(optimizer, float(clip_val))  # the spine skips it when the step overflowed

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        # manual optimization clips before the step: the spine reduces (and unscales) the gradients first
        state = self._gradients_for_clipping(optimizer) if self._gradients_for_clipping is not None else self._step
        if state.found_inf:
            return
        # elementwise, so each rank clamps its own part of each reduced gradient (a DTensor's local shard): torch's
        # clip_grad_value_ clamps them all in one foreach call, which refuses tensor-parallel DTensors mixed with
        # plain tensors (the replicated norms)
        for p in self.main_params(optimizer):
            if p.grad is not None:
                local_tensor(p.grad).clamp_(min=-clip_val, max=clip_val)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def check_supported(plugin: Any) -> None:
    """Refuse, on every rank alike, a precision plugin HybridStrategy would silently train wrong with (anything
    :meth:`HybridPrecision.from_lightning` left as it was).

    Example:
        >>> check_supported(HybridPrecision("bf16-mixed"))
    """
    if not isinstance(plugin, HybridPrecision):
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise HybridConfigError(
            f"`Trainer(precision={name!r})` is not supported by HybridStrategy: use one of"
            f" {list(PRECISIONS)}, or pass `plugins=[HybridPrecision(...)]`."
        )


def _stop_training(model: Any, scaler: DynamicLossScaler) -> None:
    """End the fit after the step, as ``EarlyStopping(check_finite=True)`` does: every rank sets ``should_stop`` at
    the same step (the overflow flag is world-wide), so Lightning's loop ends alike everywhere, with no collective
    left waiting, and the callbacks' end-of-training hooks run."""
    trainer = module_trainer(model)
    if trainer is None or trainer.should_stop:
        return
    trainer.should_stop = True
    rank_zero_warn(
        f"Stopping training: {scaler.consecutive_skipped_steps} optimizer steps in a row overflowed in fp16"
        f" (`max_consecutive_skipped_steps={scaler.max_consecutive_skipped_steps}`), at loss scale {scaler.scale}."
        " Weights and optimizer state are those from before the first of them. Check the data and the learning rate,"
        " or train in bf16; raise `max_consecutive_skipped_steps` (None: never stop) to wait longer.",
        category=RuntimeWarning,
    )
