"""lightning-hybrid: 3D parallel training (tensor x pipeline x data parallel with ZeRO) for any LightningModule."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hybrid._version import __version__ as __version__
from lightning_hybrid.checkpoint.loading import ShardedCheckpointMixin, load_from_checkpoint
from lightning_hybrid.config import (
    CheckpointOptions,
    HybridConfigError,
    PipelineOptions,
    TensorParallelOptions,
    ZeroOptions,
)
from lightning_hybrid.layout import ParallelLayout
from lightning_hybrid.monitoring import CommunicationMeter, HealthChecks, HybridMonitor, grad_norm
from lightning_hybrid.planning import plan
from lightning_hybrid.precision import HybridPrecision
from lightning_hybrid.strategy import HybridStrategy

__all__ = [
    "CheckpointOptions",
    "CommunicationMeter",
    "HealthChecks",
    "HybridConfigError",
    "HybridMonitor",
    "HybridPrecision",
    "HybridStrategy",
    "ParallelLayout",
    "PipelineOptions",
    "ShardedCheckpointMixin",
    "TensorParallelOptions",
    "ZeroOptions",
    "grad_norm",
    "load_from_checkpoint",
    "plan",
]

# Registration must happen at import time in every process (Lightning's launcher re-runs the script per rank).
if HybridStrategy.strategy_name not in StrategyRegistry:
    HybridStrategy.register_strategies(StrategyRegistry)
