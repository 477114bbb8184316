"""Precision for 3D parallel training: the Lightning plugin and the world-wide dynamic loss scaler."""

from lightning_hybrid.precision.loss_scaler import DynamicLossScaler, LossScaleError, LossScalerOptions
from lightning_hybrid.precision.plugin import PRECISIONS, HybridPrecision, check_supported

__all__ = [
    "PRECISIONS",
    "DynamicLossScaler",
    "HybridPrecision",
    "LossScaleError",
    "LossScalerOptions",
    "check_supported",
]
