"""Tensor parallel: plans (automatic, Hugging Face, user dict), their application, and the vocab-parallel loss."""

from lightning_hybrid.tensor_parallel.apply import (
    apply_tensor_parallel,
    sequence_shard_shape,
    validate_tensor_parallel_plan,
)
from lightning_hybrid.tensor_parallel.plan import TensorParallelPlan, build_tensor_parallel_plan
from lightning_hybrid.tensor_parallel.styles import FusedColwiseParallel, LocalShardParallel

__all__ = [
    "FusedColwiseParallel",
    "LocalShardParallel",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "build_tensor_parallel_plan",
    "sequence_shard_shape",
    "validate_tensor_parallel_plan",
]
