"""Dynamic loss scaling for fp16, agreed by every rank of a 3D mesh.

torch's ``GradScaler`` has no hysteresis and no minimum scale, checks only the gradients of the optimizer it is given
(one rank's shard), and its FSDP variant agrees over one process group. In 3D parallel every rank holds a different
slice of the gradients (tensor shards, pipeline stages, ZeRO shards), so the overflow flag must be reduced over the
whole world or ranks would disagree about skipping a step and the replicas would drift apart. Hence this small
class; the unscale itself is torch's fused ``_amp_foreach_non_finite_check_and_unscale_``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_hybrid._torch_compat import non_finite_check_and_unscale_
from lightning_hybrid.config import HybridConfigError, takes_fields_of

__all__ = ["DynamicLossScaler", "LossScaleError", "LossScalerOptions"]


class LossScaleError(RuntimeError):
    """Raised (on every rank alike) when gradients overflow at the minimum scale and ``on_min_scale="stop"``."""


@dataclass(frozen=True, kw_only=True)
class LossScalerOptions:
    """The settings of :class:`DynamicLossScaler` (Megatron/DeepSpeed defaults), checked at construction: the one
    definition of their names, types and defaults, which ``DynamicLossScaler(...)`` and ``HybridPrecision(...)`` take
    as arguments (``config.takes_fields_of``).

    Example:
        >>> LossScalerOptions(growth_interval=500).growth_interval
        500
    """

    initial_scale: float = 2.0**16
    """The scale to start from."""
    growth_factor: float = 2.0
    """What the scale is multiplied by after ``growth_interval`` clean steps in a row."""
    backoff_factor: float = 0.5
    """What the scale is multiplied by on an overflow, once the hysteresis is used up."""
    growth_interval: int = 1000
    """The clean steps in a row before the scale grows."""
    hysteresis: int = 2
    """The overflows tolerated before the scale backs off (1: back off at once)."""
    min_scale: float = 1.0
    """The floor of the scale."""
    on_min_scale: Literal["warn", "stop"] = "warn"
    """What an overflow at ``min_scale`` does: skip the step and go on (``"warn"``) or raise :class:`LossScaleError`."""
    max_consecutive_skipped_steps: Optional[int] = 1000
    """The overflowed steps in a row after which training stops cleanly; None: never stop."""

    def __post_init__(self) -> None:
        _check_scaler_arguments(vars(self))


def _check_scaler_arguments(values: Mapping[str, Any]) -> None:
    """Refuse a loss-scaler setting that cannot work, naming the parameter, the value and the fix. The settings are
    given to ``HybridPrecision(...)`` (or the Trainer's ``plugins=``); every rank builds it alike, before any
    collective."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    initial = values["initial_scale"]
    rules = {
        "initial_scale": (number(initial) and initial > 0, "pass a positive scale to start from, e.g. 2.0**16"),
        "growth_factor": (
            number(values["growth_factor"]) and values["growth_factor"] > 1,
            "pass a factor above 1 to grow the scale by after `growth_interval` clean steps, e.g. 2.0",
        ),
        "backoff_factor": (
            number(values["backoff_factor"]) and 0 < values["backoff_factor"] < 1,
            "pass a factor between 0 and 1 (exclusive) to shrink the scale by on overflow, e.g. 0.5",
        ),
        "growth_interval": (
            integer(values["growth_interval"]) and values["growth_interval"] >= 1,
            "pass a positive integer, the clean steps before the scale grows, e.g. 1000",
        ),
        "hysteresis": (
            integer(values["hysteresis"]) and values["hysteresis"] >= 1,
            "pass a positive integer, the overflows tolerated before the scale backs off (1: back off at once), e.g. 2",
        ),
        "min_scale": (
            number(values["min_scale"])
            and 0 < values["min_scale"]
            and (not number(initial) or values["min_scale"] <= initial),
            f"pass a positive floor not above `initial_scale` ({initial!r}), e.g. 1.0",
        ),
        "on_min_scale": (
            values["on_min_scale"] in ("warn", "stop"),
            "pass 'warn' (skip the step and go on) or 'stop' (raise LossScaleError)",
        ),
        "max_consecutive_skipped_steps": (
            values["max_consecutive_skipped_steps"] is None
            or (integer(values["max_consecutive_skipped_steps"]) and values["max_consecutive_skipped_steps"] >= 1),
            "pass a positive integer, the overflowed steps in a row after which training stops (e.g. 1000), or None"
            " to keep skipping for as long as the gradients overflow",
        ),
    }
    for name, (ok, fix) in rules.items():
        if not ok:
            raise HybridConfigError(f"Loss scaler `{name}={values[name]!r}`: {fix}.")


class DynamicLossScaler:
    """Megatron/DeepSpeed-style dynamic loss scale.

    * an overflow (inf/NaN in any gradient on any rank) skips the step, resets the count of clean steps and uses up
      one unit of ``hysteresis``; once it is used up, every further overflow multiplies the scale by
      ``backoff_factor`` (never below ``min_scale``);
    * ``growth_interval`` clean steps in a row multiply the scale by ``growth_factor`` and refill the hysteresis.

    At ``min_scale``, an overflow skips the step and training goes on; the first such overflow warns (once, on rank
    0; again only after the scale has grown since). ``on_min_scale="stop"`` raises :class:`LossScaleError` there
    instead, as DeepSpeed does. After ``max_consecutive_skipped_steps`` overflowed steps in a row (at any scale),
    :attr:`stop_requested` turns True and :class:`~lightning_hybrid.HybridPrecision` ends the fit cleanly, as
    ``EarlyStopping`` does; ``None`` never stops.

    Example:
        >>> scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1, max_consecutive_skipped_steps=2)
        >>> scaler.update(found_inf=True)
        >>> scaler.scale, scaler.skipped_steps, scaler.stop_requested
        (4.0, 1, False)
        >>> scaler.update(found_inf=True)
        >>> scaler.consecutive_skipped_steps, scaler.stop_requested
        (2, True)
    """

    @takes_fields_of(LossScalerOptions, keyword_only=False)
    def __init__(self, **settings: Any) -> None:
        options = LossScalerOptions(**settings)  # each setting checked once, on every rank alike
        self.growth_factor, self.backoff_factor = float(options.growth_factor), float(options.backoff_factor)
        self.growth_interval, self.hysteresis = options.growth_interval, options.hysteresis
        self.min_scale, self.on_min_scale = float(options.min_scale), options.on_min_scale
        self.scale = float(options.initial_scale)
        self.clean_steps = 0
        """Steps without overflow since the last growth or overflow."""
        self.hysteresis_left = options.hysteresis
        self.skipped_steps = 0
        """Optimizer steps skipped because of an overflow, since the start of training (running count)."""
        self.max_consecutive_skipped_steps = options.max_consecutive_skipped_steps
        self.consecutive_skipped_steps = 0
        """Optimizer steps skipped in a row, up to the last one (0 after a clean step)."""
        self._warned_at_min_scale = False

    @torch.no_grad()
    def unscale_(self, gradients: Iterable[Tensor], device: torch.device) -> bool:
        """Divide ``gradients`` (this rank's, in place) by the scale; return whether any rank saw an inf/NaN.

        Collective: every rank calls it once per optimizer step, with whatever gradients it holds (maybe none).
        """
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in gradients:
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if dist.is_available() and dist.is_initialized():
            # the whole world, not one group: a skipped step must be skipped by every TP, PP and DP rank
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    @property
    def stop_requested(self) -> bool:
        """Whether the last ``max_consecutive_skipped_steps`` steps all overflowed: training should end. The same on
        every rank, since ``update`` takes the world-wide flag."""
        limit = self.max_consecutive_skipped_steps
        return limit is not None and self.consecutive_skipped_steps >= limit

    def update(self, found_inf: bool) -> None:
        """Advance the schedule after a step (``found_inf`` must be the world-wide flag, so all ranks agree)."""
        if not found_inf:
            self.consecutive_skipped_steps = 0
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
                self.hysteresis_left = self.hysteresis
                self._warned_at_min_scale = False  # recovered: a later storm at the floor warns again
            return
        self.skipped_steps += 1
        self.consecutive_skipped_steps += 1
        self.clean_steps = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return
        if self.scale <= self.min_scale:
            message = (
                f"Gradients overflow at the minimum loss scale ({self.min_scale}): the step is skipped"
                f" ({self.consecutive_skipped_steps} in a row, {self.skipped_steps} in all). The loss or gradients are"
                " inf/NaN regardless of scaling; lower the learning rate, check the data, or use bf16."
            )
            if self.on_min_scale == "stop":
                raise LossScaleError(message + " (Set `on_min_scale='warn'` to keep training instead.)")
            if not self._warned_at_min_scale:
                # once per storm, not once per step: a storm of thousands of steps would bury every other message
                limit = self.max_consecutive_skipped_steps
                then = (
                    f"training stops cleanly after {limit} overflowed steps in a row (`max_consecutive_skipped_steps`)"
                    if limit is not None
                    else "training keeps skipping for as long as they overflow (`max_consecutive_skipped_steps=None`)"
                )
                rank_zero_warn(
                    f"{message} Weights and optimizer state are kept as they are; further overflowed steps are"
                    f" skipped without a warning, and {then}.",
                    category=RuntimeWarning,
                )
                self._warned_at_min_scale = True
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped_steps": self.consecutive_skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skipped_steps = int(state.get("consecutive_skipped_steps", 0))  # absent before it existed
