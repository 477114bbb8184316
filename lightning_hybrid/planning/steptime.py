"""An estimated step time: compute from FLOPs at a stated MFU, communication from volumes and bandwidths, and the
pipeline bubble from the schedule. A first-order model to rank layouts, not a simulator.

- Compute: ``6 N`` FLOPs per token for the weights plus ``12 L h s`` for attention (Narayanan et al. 2021), a third
  more under full recompute (one more forward), at ``mfu`` of the devices' peak.
- Tensor parallel: per block and micro-batch, two all-reduces forward and two backward of ``s b h`` activations
  (sequence parallel's all-gather + reduce-scatter move the same bytes), ring volume ``2 (t-1)/t``, on the
  intra-node link; not overlapped.
- Data parallel: gradients all-reduced (ZeRO-0) or reduce-scattered with parameters all-gathered back (ZeRO-1/2),
  ``2 (d-1)/d`` of the gradient bytes; ZeRO-3 gathers the parameters for forward and again for backward (once under
  pipeline parallel, which keeps them) and reduce-scatters gradients. On the network when the data-parallel group
  spans nodes. Overlapped with backward where the strategy overlaps it (bucketed ZeRO-0/2 and ZeRO-3, without
  pipeline parallel): only what exceeds the backward time counts.
- Pipeline: each micro-batch's activation crosses each stage boundary forward and its gradient backward; the bubble
  is ``(p-1)/m`` of the compute for GPipe/1F1B, ``(p-1)/(m v)`` interleaved, a third of 1F1B's for interleaved
  zero-bubble and none for zero-bubble V.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hybrid.planning.hardware import Hardware
from lightning_hybrid.planning.model import ModelSpec

__all__ = ["StepTime", "bubble_fraction", "estimate_step_time"]


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tensor: float
    data: float
    pipeline: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tensor + self.data + self.pipeline


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of a step relative to its compute, for ``p`` stages and ``m`` micro-batches.

    Example:
        >>> bubble_fraction("1f1b", 4, 16)
        0.1875
    """
    if p == 1:
        return 0.0
    if schedule == "zbv_zero_bubble":
        return 0.0
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and v > 1:
        f = (p - 1) / (m * v)
        return f / 3 if schedule == "interleaved_zero_bubble" else f
    return (p - 1) / m


def estimate_step_time(
    spec: ModelSpec,
    hardware: Hardware,
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int,
    zero_stage: int,
    micro_batch: int,
    num_microbatches: int,
    grad_bytes: float,
    act_bytes: int = 2,
    schedule: str = "1f1b",
    virtual: int = 1,
    recompute: str = "none",
    mfu: float = 0.4,
) -> StepTime:
    """Seconds per optimizer step of ``data_parallel x num_microbatches x micro_batch`` sequences."""
    t, p, d, m, b = tensor_parallel_size, pipeline_parallel_size, data_parallel_size, num_microbatches, micro_batch
    s, h, L = spec.seq, spec.hidden, spec.layers
    tokens = d * m * b * s
    dense = 6 * spec.total_params * (4 / 3 if recompute == "full" else 1)
    flops = tokens * (dense + 12 * L * h * s)
    compute = flops / (hardware.world_size * hardware.peak_flops * mfu)
    bubble = compute * bubble_fraction(schedule, p, m, virtual)
    intra, inter = hardware.intra_node_bandwidth, hardware.inter_node_bandwidth
    tensor = 0.0
    if t > 1:
        volume = 4 * (L / p) * m * act_bytes * s * b * h * 2 * (t - 1) / t
        tensor = volume / (intra if t <= hardware.devices_per_node else inter)
    data = 0.0
    if d > 1:
        local_params = spec.total_params / (t * p)
        ring = (d - 1) / d
        if zero_stage == 3:
            gathers = 1 if p > 1 else 2
            volume = (gathers * act_bytes + grad_bytes) * local_params * ring
        else:
            volume = 2 * grad_bytes * local_params * ring
        spans_nodes = t * d > hardware.devices_per_node
        data = volume / (inter if spans_nodes else intra)
        overlapped = p == 1 and zero_stage in (0, 2, 3)
        if overlapped:
            data = max(0.0, data - compute * 2 / 3)  # backward is about two thirds of the compute
    pipeline = 0.0
    if p > 1:
        crosses_nodes = t * d * p > hardware.devices_per_node
        pipeline = 2 * m * act_bytes * s * b * h / (inter if crosses_nodes else intra)
    return StepTime(compute, bubble, tensor, data, pipeline)
