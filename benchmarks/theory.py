"""What each layout should cost per rank per optimizer step, to set the measured numbers against.

Communication is compared in bytes on the wire per rank, for ring algorithms: a collective over ``n`` ranks on a
buffer of ``S`` bytes moves ``2(n-1)/n * S`` for all-reduce, ``(n-1)/n * S`` for all-gather (``S`` = the gathered
output) and reduce-scatter (``S`` = the unreduced input), ``S`` for a send or a receive. The meter
(``CommunicationMeter``) counts buffers (``S``); :func:`wire_bytes` applies these factors.

Example:
    >>> wire_bytes("all_reduce", 1000, 2)
    1000.0
    >>> data_parallel_minimum(zero_stage=3, gradient_bytes=1000, parameter_bytes=1000, data_parallel_size=2)
    1500.0
"""

from __future__ import annotations

from typing import Optional

_RING = {"all_reduce": 2.0, "all_gather": 1.0, "all_gather_into_tensor": 1.0, "all_gather_single": 1.0,
         "reduce_scatter": 1.0, "reduce_scatter_tensor": 1.0, "reduce_scatter_single": 1.0,
         "broadcast": 1.0, "reduce": 1.0}  # fmt: skip
_POINT_TO_POINT = {"send", "recv", "isend", "irecv"}


def wire_bytes(collective: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective whose buffer is ``buffer_bytes``, ring algorithm (see module doc)."""
    if collective in _POINT_TO_POINT:
        return float(buffer_bytes)
    if group_size <= 1:
        return 0.0
    return _RING.get(collective, 1.0) * (group_size - 1) / group_size * buffer_bytes


def data_parallel_minimum(
    *, zero_stage: int, gradient_bytes: float, parameter_bytes: float, data_parallel_size: int
) -> float:
    """Fewest wire bytes per rank per step for the data dimension: all-reduce of gradients (ZeRO 0), reduce-scatter
    of gradients + all-gather of updated parameters (ZeRO 1/2: the same volume), and for ZeRO-3 the parameters
    gathered twice (forward and backward) plus the gradients reduce-scattered: 1.5x ZeRO 0 (Rajbhandari et al.)."""
    n = data_parallel_size
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if zero_stage == 3:
        return share * (2 * parameter_bytes + gradient_bytes)
    return share * (gradient_bytes + parameter_bytes)


def tensor_parallel_minimum(
    *, activation_bytes: float, blocks: int, has_embedding: bool, has_head: bool, tensor_parallel_size: int
) -> float:
    """Megatron's count: per block, one all-reduce after attention and one after the MLP in the forward pass and one
    of each in the backward pass, each on the block's activations; one for the vocabulary-parallel embedding (forward)
    and one for the head's input gradient (backward). ``activation_bytes``: the step's (all micro-batches) hidden
    states, batch x sequence x width x 4. The loss's few per-token reductions are left out (width x smaller)."""
    n = tensor_parallel_size
    count = 4 * blocks + int(has_embedding) + int(has_head)
    return wire_bytes("all_reduce", count * activation_bytes, n)


def pipeline_minimum(*, activation_bytes: float, local_stages: list[int], num_stages: int) -> float:
    """Per local stage: the activations in and their gradients out from the previous stage, and the activations out
    and gradients in from the next: ``activation_bytes`` (all micro-batches) each way; nothing for a neighbour stage
    on the same rank (the V schedule's middle: stages p-1 and p)."""
    local = set(local_stages)
    total = 0.0
    for s in local_stages:
        total += 2 * activation_bytes * ((s > 0 and s - 1 not in local) + (s < num_stages - 1 and s + 1 not in local))
    return total


def theoretical_bubble(schedule: str, p: int, m: int, v: int) -> Optional[float]:
    """(p-1)/(v*m+p-1) for GPipe, 1F1B and interleaved 1F1B; None for the zero-bubble schedules (their idle time
    depends on the backward's input/weight split, not on p and m alone)."""
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        from lightning_hybrid.pipeline.timeline import theoretical_bubble as formula

        return formula(p, m, v)
    return None
