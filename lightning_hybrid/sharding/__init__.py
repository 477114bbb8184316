"""ZeRO sharding over the data-parallel dimension, and the per-rank model-state report.

Modules, one mechanism each: :mod:`.flat` (the flat gradient and shard buffers, and the collectives over them),
:mod:`.gradient_sync` (tensor-parallel replicas' gradients made consistent), :mod:`.buckets` (DDP-style buckets
overlapped with backward, ZeRO-0), :mod:`.sharded_buckets` (ZeRO-2 buckets reduced to the shard owners during
backward), :mod:`.sharded_optimizer` (ZeRO-0/1/2 around the user's optimizer), :mod:`.fsdp` (ZeRO-3 with FSDP2),
:mod:`.norm` (the global gradient norm), :mod:`.offload` (optimizer steps on the host), :mod:`.memory` (the model-state
report) and :mod:`.step` (one optimizer step's gradients, in order).
"""

from lightning_hybrid.sharding.buckets import GradientBuckets
from lightning_hybrid.sharding.fsdp import apply_fully_shard, check_user_sharding, user_fully_sharded
from lightning_hybrid.sharding.gradient_sync import GradientSync
from lightning_hybrid.sharding.memory import expected_model_state_bytes, measure_model_state_bytes
from lightning_hybrid.sharding.sharded_buckets import ShardedGradientBuckets
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

__all__ = [
    "GradientBuckets",
    "GradientSync",
    "ShardedGradientBuckets",
    "ShardedOptimizer",
    "apply_fully_shard",
    "check_user_sharding",
    "expected_model_state_bytes",
    "measure_model_state_bytes",
    "user_fully_sharded",
]
