"""Model-state memory per rank: measured from the tensors a rank holds, and the ZeRO formula to compare it with."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid.dtensor import local_bytes
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

__all__ = ["expected_model_state_bytes", "measure_model_state_bytes"]


def measure_model_state_bytes(
    module: nn.Module, optimizers: list[Optimizer], sharded: Optional[list[ShardedOptimizer]] = None
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds right now (local shards only).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(4, 4)
        >>> measure_model_state_bytes(m, [])["parameters"]
        80
    """
    params = {id(p): p for p in module.parameters()}.values()
    out = {"parameters": sum(local_bytes(p) for p in params)}
    if sharded:
        out["gradients"] = sum(z.gradient_bytes() for z in sharded)
        out["optimizer_state"] = sum(z.state_bytes() for z in sharded)
    else:
        out["gradients"] = sum(local_bytes(p.grad) for p in params if p.grad is not None)
        out["optimizer_state"] = sum(
            local_bytes(t)
            for opt in optimizers
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, Tensor) and t.dim() > 0
        )
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
    return out


def expected_model_state_bytes(
    local_numel: int,
    *,
    zero_stage: int,
    data_parallel_size: int,
    precision: str = "32-true",
    param_bytes: Optional[int] = None,
    grad_bytes: int = 4,
    master_bytes: int = 4,
    optimizer_states: int = 2,
    state_bytes: int = 4,
) -> dict[str, float]:
    """The ZeRO formula (Rajbhandari et al., 2020) per rank for ``local_numel`` parameters (already split by TP/PP).

    Stages 1/2 keep a master copy of the rank's shard inside the optimizer (as DeepSpeed does); stage 3 steps the
    sharded parameters themselves, so it has no separate master copy. ``precision``: the ``-mixed`` modes hold what
    ``32-true`` holds; ``bf16-true``/``16-true`` hold 2-byte parameters, an fp32 master copy in the optimizer (even
    at stage 0) and fp32 gradients; at stage 3 the fp32 shard is the master and the 2-byte copies are transient.

    Example:
        >>> expected_model_state_bytes(1000, zero_stage=1, data_parallel_size=2)["optimizer_state"]
        6000.0
        >>> expected_model_state_bytes(1000, zero_stage=1, data_parallel_size=2, precision="bf16-true")["parameters"]
        2000
    """
    dp = data_parallel_size
    if dp == 1 and zero_stage in (1, 2):
        zero_stage = 0  # one replica has nothing to shard: the strategy steps it as stage 0 (no fp32 copy)
    low = precision in ("bf16-true", "16-true")
    if param_bytes is None:
        param_bytes = 2 if low and zero_stage < 3 else 4
    optimizer = optimizer_states * state_bytes
    return {
        0: {
            "parameters": param_bytes * local_numel,
            "gradients": grad_bytes * local_numel,
            "optimizer_state": (optimizer + (master_bytes if low else 0)) * local_numel,
        },
        1: {
            "parameters": param_bytes * local_numel,
            "gradients": grad_bytes * local_numel,
            "optimizer_state": (master_bytes + optimizer) * local_numel / dp,
        },
        2: {
            "parameters": param_bytes * local_numel,
            "gradients": grad_bytes * local_numel / dp,
            "optimizer_state": (master_bytes + optimizer) * local_numel / dp,
        },
        3: {
            "parameters": param_bytes * local_numel / dp,
            "gradients": grad_bytes * local_numel / dp,
            "optimizer_state": optimizer * local_numel / dp,
        },
    }[zero_stage]
