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
- Mixture of experts: the FLOPs are those of the *active* parameters (the dense ones and ``top_k`` experts per MoE
  layer); under expert parallel with tensor parallel every tensor rank computes its experts whole, ``t`` times the
  expert FLOPs. Expert weights' gradients are reduced over the ``dp / ep`` ranks holding them, and not overlapped
  with backward at ZeRO-0/2 (the strategy's buckets stand aside for them).
- Expert parallel's all-to-all, its own term: per MoE layer of the busiest stage and micro-batch, four all-to-alls
  (dispatch and combine, forward and backward) of the ``b s top_k`` routed rows of ``h`` values, of which
  ``(ep-1)/ep`` leave the rank under uniform routing: ``4 L_moe m b s top_k h bytes (ep-1)/ep`` over the intra-node
  bandwidth when the ``t x ep`` ranks of an expert group fit in a node, the network otherwise; not overlapped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_hybrid.planning.hardware import Hardware
from lightning_hybrid.planning.model import ModelSpec

__all__ = ["StepTime", "bubble_fraction", "estimate_step_time", "moe_layers_per_stage"]


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tensor: float
    data: float
    pipeline: float
    all_to_all: float = 0.0
    """Expert parallel's token dispatch and combine, context parallel's exchange of heads (0 without either)."""

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tensor + self.data + self.pipeline + self.all_to_all

    def as_dict(self) -> dict[str, float]:
        """The terms and their total, in seconds.

        Example:
            >>> StepTime(1.0, 0.0, 0.0, 0.5, 0.0, 0.25).as_dict()["total"]
            1.75
        """
        return {**asdict(self), "total": self.total}


def moe_layers_per_stage(spec: ModelSpec, pipeline_parallel_size: int) -> list[int]:
    """Mixture-of-experts layers on each pipeline stage, the blocks cut into stages of ``ceil(L / p)``.

    Example:
        >>> spec = ModelSpec(layers=4, hidden=8, heads=2, family="llama", experts=4, top_k=1, dense_layers=1)
        >>> moe_layers_per_stage(spec, 2)
        [1, 2]
    """
    per = -(-spec.layers // pipeline_parallel_size)
    moe = spec.moe_layer_indices
    return [sum(1 for i in moe if s * per <= i < (s + 1) * per) for s in range(pipeline_parallel_size)]


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
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> StepTime:
    """Seconds per optimizer step of ``data_parallel x num_microbatches x micro_batch`` sequences. Under context
    parallel, ``spec.seq`` is one rank's part of the sequence and ``data_parallel_size`` counts replicas x context
    ranks (the mesh's data dimension, which reduces the gradients).

    Example (Mixtral-8x7B on 8 H100s, data parallel with the experts over all 8: the all-to-all term):
        >>> from lightning_hybrid.planning.hardware import Hardware
        >>> spec = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, family="llama",
        ...                  experts=8, top_k=2)
        >>> step = estimate_step_time(spec, Hardware.preset("H100"), tensor_parallel_size=1,
        ...     pipeline_parallel_size=1, data_parallel_size=8, zero_stage=3, micro_batch=1, num_microbatches=1,
        ...     grad_bytes=4, expert_parallel_size=8)
        >>> round(step.all_to_all * 1e3, 2)  # 4 x 32 layers x 4096 x 2 rows x 4096 x 2 bytes x 7/8 / 450 GB/s
        16.7
    """
    t, p, d, m, b = tensor_parallel_size, pipeline_parallel_size, data_parallel_size, num_microbatches, micro_batch
    s, h, L, ep = spec.seq, spec.hidden, spec.layers, expert_parallel_size
    tokens = d * m * b * s
    # active parameters: under expert parallel x tensor parallel each tensor rank computes its experts whole
    active_experts = spec.active_params - spec.dense_params
    active = spec.dense_params + active_experts * (t if ep > 1 else 1)
    dense = 6 * active * (4 / 3 if recompute == "full" else 1)
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
        # dense weights over all d ranks; expert weights (1/ep of them, or 1/t under moe_tp_experts) over d / ep
        local = [(spec.dense_params / (t * p), d), (spec.expert_params / ((ep if ep > 1 else t) * p), d // ep)]
        volume = 0.0
        for local_params, ranks in local:
            ring = (ranks - 1) / ranks
            if zero_stage == 3:
                gathers = 1 if p > 1 else 2
                volume += (gathers * act_bytes + grad_bytes) * local_params * ring
            else:
                volume += 2 * grad_bytes * local_params * ring
        spans_nodes = t * d > hardware.devices_per_node
        data = volume / (inter if spans_nodes else intra)
        overlapped = p == 1 and (zero_stage == 3 or (zero_stage in (0, 2) and ep == 1))
        if overlapped:
            data = max(0.0, data - compute * 2 / 3)  # backward is about two thirds of the compute
    pipeline = 0.0
    if p > 1:
        crosses_nodes = t * d * p > hardware.devices_per_node
        pipeline = 2 * m * act_bytes * s * b * h / (inter if crosses_nodes else intra)
    all_to_all = 0.0
    if ep > 1 and spec.is_moe:
        moe_layers = max(moe_layers_per_stage(spec, p))
        volume = 4 * moe_layers * m * b * s * spec.top_k * h * act_bytes * (ep - 1) / ep
        all_to_all = volume / (intra if t * ep <= hardware.devices_per_node else inter)
    cp = context_parallel_size
    if cp > 1:
        # Ulysses: q, k and v to whole sequences of a share of the heads, and the attention output back, over the
        # context ranks, in forward and backward (and the forward's again under full recompute)
        passes = 3 if recompute == "full" else 2
        qkvo = 2 * h + 2 * spec.kv * (h // spec.heads)
        volume = passes * (L / p) * m * b * s * qkvo / t * act_bytes * (cp - 1) / cp
        all_to_all += volume / (intra if t * cp <= hardware.devices_per_node else inter)
    return StepTime(compute, bubble, tensor, data, pipeline, all_to_all)
