"""ZeRO sharding over the data-parallel dimension, and the per-rank model-state report."""

from lightning_hybrid.sharding.batch_norm import sync_batch_norm
from lightning_hybrid.sharding.memory import expected_model_state_bytes, measure_model_state_bytes
from lightning_hybrid.sharding.zero import (
    GradientBuckets,
    GradientSync,
    ShardedGradientBuckets,
    ShardedOptimizer,
    apply_fully_shard,
    check_user_sharding,
    local_grad,
    local_tensor,
    user_fully_sharded,
)

__all__ = [
    "GradientBuckets",
    "GradientSync",
    "ShardedGradientBuckets",
    "ShardedOptimizer",
    "apply_fully_shard",
    "check_user_sharding",
    "expected_model_state_bytes",
    "local_grad",
    "local_tensor",
    "measure_model_state_bytes",
    "sync_batch_norm",
    "user_fully_sharded",
]
