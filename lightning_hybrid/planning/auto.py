"""``HybridStrategy(layout="auto")``: the planner's best feasible layout for the world size and device memory."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError, checkpoint_mode
from lightning_hybrid.layout import LayoutRequest

__all__ = ["auto_layout", "auto_request"]


def auto_layout(
    module: nn.Module,
    *,
    world_size: int,
    devices_per_node: int,
    device: torch.device,
    device_memory: Optional[float],
    precision: str,
    activation_checkpointing: Union[bool, str, None],
    schedule: str,
    virtual_stages: int,
    sequence_parallel: bool = False,
) -> tuple[dict[str, Any], Optional[int], str]:
    """The sizes of the best feasible layout, its micro-batch count, and the lines to log (layout and ledger).

    The micro-batch size and sequence length come from ``module.example_input_array`` (batch x sequence) when it
    has one. ``device_memory`` (GB) is required on CPU; on CUDA the device's total memory
    (``torch.cuda.mem_get_info``) is taken, the same on every rank of one GPU model, so every rank plans alike.
    """
    from lightning_hybrid.planning import GB, ModelSpec, plan

    if device_memory is None:
        if device.type != "cuda":
            raise HybridConfigError("`layout='auto'` on CPU needs `device_memory=` (GB per process) to plan against.")
        device_memory = torch.cuda.mem_get_info(device)[1] / GB
    example = getattr(module, "example_input_array", None)
    shape = tuple(example.shape) if isinstance(example, torch.Tensor) and example.dim() >= 2 else None
    spec = ModelSpec.from_module(module, seq=shape[1] if shape else None)
    if world_size % devices_per_node:
        devices_per_node = world_size
    result = plan(
        spec,
        micro_batch=shape[0] if shape else 1,
        precision=precision if precision != "32" else "32-true",
        optimizer="adamw",
        recompute=checkpoint_mode(activation_checkpointing) or "none",  # the strategy's mode is the planner's
        device_memory=device_memory,
        devices_per_node=devices_per_node,
        nodes=world_size // devices_per_node,
        schedule=schedule,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        expert_parallel_size=1,  # `layout="auto"` takes no explicit size, expert_parallel_size included: none chosen
    )
    best = result.best
    if best is None:
        worst = result.layouts[0]
        raise HybridConfigError(
            f"`layout='auto'`: no layout of {world_size} processes fits {device_memory:g} GB per device; the"
            f" closest, {worst.candidate.describe()}, needs {worst.reason}. Add devices, turn on"
            " `activation_checkpointing`, or lower the micro-batch size."
        )
    c = best.candidate
    sizes = {k: v for k, v in c.sizes().items() if k != "expert_parallel_size"}  # always 1 here
    from lightning_hybrid.planning.search import _gb

    ledger = ", ".join(f"{k} {_gb(v)}" for k, v in best.ledger.as_dict().items())
    message = (
        f"lightning-hybrid layout='auto' chose tp={c.tensor_parallel_size} x pp={c.pipeline_parallel_size} x"
        f" dp={c.data_parallel_size}, zero_stage={c.zero_stage}, num_microbatches={c.num_microbatches}"
        f" ({best.reason}); ledger per device: {ledger}\n{result.table(limit=5)}"
    )
    return sizes, (c.num_microbatches if c.pipeline_parallel_size > 1 else None), message


def auto_request(request: LayoutRequest, module: nn.Module, **machine: Any) -> tuple[LayoutRequest, str]:
    """``request`` with the sizes and micro-batch count of :func:`auto_layout`'s best layout (``machine``: its
    ``world_size``, ``devices_per_node``, ``device``, ``device_memory``, ``precision``, ``activation_checkpointing``),
    and the lines to log. The schedule, virtual stages and sequence parallel setting are the request's own.

    Example:
        >>> # request, message = auto_request(request, module, world_size=8, devices_per_node=8, ...)
    """
    pipeline = request.pipeline
    sizes, num_microbatches, message = auto_layout(
        module,
        schedule=pipeline.schedule,
        virtual_stages=pipeline.virtual_pipeline_size,
        sequence_parallel=request.sequence_parallel,
        **machine,
    )
    # num_microbatches None: the pipeline size (LayoutRequest.resolve)
    return replace(request, **sizes, pipeline=replace(pipeline, num_microbatches=num_microbatches)), message
