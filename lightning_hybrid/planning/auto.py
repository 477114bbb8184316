"""``HybridStrategy(layout="auto")``: the planner's best feasible layout for the world size and device memory."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError, LayoutRequest

__all__ = ["auto_layout", "auto_request", "check_auto_layout"]

_DEFAULT_SIZES = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": "auto", "zero_stage": 1}


def check_auto_layout(layout: Optional[str], sizes: dict[str, Any], num_microbatches: Optional[int]) -> None:
    """``layout`` is None or ``"auto"``; ``"auto"`` takes no explicit size (the planner chooses them all)."""
    if layout is None:
        return
    if layout != "auto":
        raise HybridConfigError(f"`layout={layout!r}` must be 'auto' (let the planner choose) or None.")
    given = {k: v for k, v in sizes.items() if k in _DEFAULT_SIZES and v != _DEFAULT_SIZES[k]}
    if num_microbatches is not None:
        given["num_microbatches"] = num_microbatches
    if given:
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise HybridConfigError(
            f"`layout='auto'` chooses the layout itself, but explicit sizes were given ({args}). Drop them, or drop"
            " `layout='auto'` to use them. To fix one dimension and plan the rest, run `lightning-hybrid plan` with"
            " e.g. `--tensor-parallel-size` and pass its answer."
        )


def auto_layout(
    module: nn.Module,
    *,
    world_size: int,
    devices_per_node: int,
    device: torch.device,
    device_memory: Optional[float],
    precision: str,
    activation_checkpointing: bool,
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
        recompute="full" if activation_checkpointing else "none",
        device_memory=device_memory,
        devices_per_node=devices_per_node,
        nodes=world_size // devices_per_node,
        schedule=schedule,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
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
    sizes = c.sizes()
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
        virtual_stages=pipeline.virtual_size,
        sequence_parallel=request.sequence_parallel,
        **machine,
    )
    # num_microbatches None: the pipeline size (LayoutRequest.resolve)
    return replace(request, **sizes, pipeline=replace(pipeline, num_microbatches=num_microbatches)), message
