"""HybridPrecision: Lightning's precision plugin for HybridStrategy.

This release covers ``"32-true"`` and ``"bf16-mixed"`` (bf16 autocast over fp32 parameters) and clips gradients by
the *global* norm across tensor, pipeline and ZeRO shards (Lightning's own plugins clip each rank's shard by its own
norm). fp16 with a loss scaler agreed by all ranks and the ``-true`` modes with fp32 master weights are not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from lightning_hybrid.config import HybridConfigError

__all__ = ["HybridPrecision"]

_SUPPORTED = ("32-true", "bf16-mixed")


class HybridPrecision(Precision):
    """Precision plugin used by :class:`~lightning_hybrid.HybridStrategy` for ``Trainer(precision=...)``.

    Example:
        >>> import lightning as L
        >>> from lightning_hybrid import HybridStrategy
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(), precision="bf16-mixed")
    """

    def __init__(self, precision: Literal["32-true", "bf16-mixed"] = "32-true", device: str = "cpu") -> None:
        if precision not in _SUPPORTED:
            raise HybridConfigError(
                f"`HybridPrecision(precision={precision!r})` is not supported yet; use one of {list(_SUPPORTED)}."
            )
        self.precision = precision
        self.device = device
        self._clip_by_norm: Optional[Callable[[float], float]] = None
        self.last_gradient_norm: Optional[float] = None
        """The global gradient norm before clipping, at the last clipped step."""

    @classmethod
    def from_lightning(cls, plugin: Optional[Precision]) -> Optional[Precision]:
        """The HybridPrecision equivalent of the plugin Lightning picked for ``Trainer(precision=...)``; other
        plugins are returned unchanged (and refused by the strategy at set-up)."""
        if plugin is None or isinstance(plugin, HybridPrecision):
            return plugin
        if type(plugin) is Precision:
            return cls("32-true")
        if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
            return cls("bf16-mixed", plugin.device)
        return plugin

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device, dtype=torch.bfloat16):
                yield
        else:
            yield

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self._clip_by_norm is None:
            raise RuntimeError("HybridPrecision clips by norm only inside HybridStrategy.")
        self.last_gradient_norm = self._clip_by_norm(float(clip_val))
