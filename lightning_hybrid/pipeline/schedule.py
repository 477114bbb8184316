"""Building torch's schedule for one shape of a step's network calls: what crosses each stage boundary, and the
stages sized by it.

torch's ``PipelineStage`` allocates its receive buffers from example tensors given in advance, so the shape and dtype
of what enters each stage must be known before the schedule runs: read off a forward of the unsplit network's meta
copy on the step's own network inputs (pipeline/boundaries.py; blocks may change the hidden state's shape), or, where
that cannot run, the hidden state entering the first block. A step that calls the network several times sends one
activation per call across each boundary (pipeline/calls.py says how many).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._hooks import capture_call, first_tensor
from lightning_hybrid._torch_compat import AsyncCollectiveTensor
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.pipeline.boundaries import TensorSpec, UnsplitForward, trace_unsplit_forward
from lightning_hybrid.pipeline.calls import CallPlan
from lightning_hybrid.pipeline.paused import NetworkCall
from lightning_hybrid.pipeline.stage import NetworkSplit
from lightning_hybrid.pipeline.step_data import ActionTimer, TimedStage
from lightning_hybrid.pipeline_schedules import MULTI_STAGE, SCHEDULES

__all__ = ["boundaries", "build_schedule", "sendable"]


def _first_block_input(
    split: NetworkSplit, stages: dict[int, nn.Module], network_forward: Callable[..., Any], call: NetworkCall
) -> Tensor:
    """The hidden state entering the block list, from a forward that stops at its entrance (stubs make it cheap
    off the first stage): its dtype is the boundaries' (after a '-true' cast, which the meta copy missed)."""
    stage = min(stages)
    # the probe calls the network directly, not through the stage module: gather ZeRO-3 input modules by hand
    fsdp = [m for m in stages.values() if hasattr(m, "unshard") and hasattr(m, "reshard")]
    for m in fsdp:
        m.unshard()
    try:
        # off the first stage the input modules are already stubs (split_network): nothing to switch
        with torch.no_grad(), split.active(stage) if stage == 0 else nullcontext(), call.state.applied():
            entry = capture_call(split.blocks[0], partial(network_forward, *call.args, **call.kwargs))
    finally:
        for m in fsdp:
            m.reshard()
    found = first_tensor(*entry) if entry is not None else None
    if found is None:
        raise HybridConfigError("Could not find the hidden state entering the block list for pipeline parallel.")
    hidden = found[1]
    if isinstance(hidden, AsyncCollectiveTensor):
        # a tensor-parallel input module's output reduction is issued async and waited by the op that reads it; only
        # its shape is read here, so wait it: c10d otherwise warns of an unwaited collective at the process's exit
        hidden = hidden.wait()
    return hidden


def boundaries(
    split: NetworkSplit,
    stages: dict[int, nn.Module],
    network_forward: Callable[..., Any],
    call: NetworkCall,
    *,
    training: bool,
    device: torch.device,
) -> tuple[list[TensorSpec], Optional[UnsplitForward]]:
    """The shape and dtype of what enters each stage for the network call ``call``, from a forward of the unsplit
    network's meta copy under the step's autocast (pipeline/boundaries.py; blocks may change the shape and the
    dtype), and that forward. Where it cannot run: every boundary as the hidden state entering the first block, and
    None. Raises ``HybridConfigError`` where the cut does not fit what that forward shows (a value passed outside the
    hidden state across a cut, a shape changed between blocks where a stage ends).

    Example:
        >>> # specs, trace = boundaries(split, runner.stages, network.forward, call, training=True, device=device)
    """
    hidden = _first_block_input(split, stages, network_forward, call)
    trace = None
    if split.unsplit is not None:
        with call.state.applied():
            trace = trace_unsplit_forward(
                split.unsplit, split.blocks_name, call.args, call.kwargs, training=training,
                inputs=split.input_names, device=device,
            )  # fmt: skip
    if trace is None:
        return [TensorSpec(tuple(hidden.shape), hidden.dtype)] * split.num_stages, None
    return trace.stage_inputs(split.plan, split.blocks_name), trace


def build_schedule(
    stages: dict[int, nn.Module],
    split: NetworkSplit,
    plan: CallPlan,
    *,
    name: str,
    training: bool,
    microbatches: int,
    device: torch.device,
    activation_shape: Callable[[tuple[int, ...]], tuple[int, ...]],
    group: Any,
    timer: ActionTimer,
) -> tuple[Any, dict[int, tuple[Tensor, ...]]]:
    """torch's schedule ``name`` over this rank's ``stages``, each boundary carrying one activation per network call
    of ``plan``; and per stage of this rank but the last, examples of what it sends (one per call)."""
    from torch.distributed import pipelining

    def example(boundary: tuple[tuple[int, ...], torch.dtype]) -> Tensor:
        shape, dtype = boundary
        return torch.zeros(activation_shape(shape), dtype=dtype, device=device)

    last = split.num_stages - 1
    entering = [tuple(example(per_call[s]) for per_call in plan.entering) for s in range(split.num_stages)] if (
        plan.calls
    ) else [()]  # a one-stage pipeline: no boundary
    sends = {s: entering[s + 1] for s in stages if s != last}
    built = []
    for s, module in sorted(stages.items()):
        # example tensors' requires_grad tells the stage which gradients cross stage borders
        if s == 0:
            inputs: Any = torch.zeros(1, dtype=torch.long, device=device)
        else:
            inputs = tuple(e.detach().clone().requires_grad_(training) for e in entering[s])
        if s == last:  # the last stage's output: the micro-batch loss, shape [1]
            outputs: Any = torch.zeros(1, dtype=torch.float32, device=device).requires_grad_(training)
        else:
            outputs = tuple(e.detach().clone().requires_grad_(training) for e in entering[s + 1])
        built.append(TimedStage(module, s, split.num_stages, device, input_args=inputs, output_args=outputs,
                                group=group, timer=timer))  # fmt: skip
    if not training and name not in MULTI_STAGE:
        # forward only, every single-stage schedule runs the forwards in the same order; GPipe has no lower bound
        # on the micro-batches (1F1B wants one per stage), which an evaluation's last, smaller batch may not give
        name = "gpipe"
    cls = getattr(pipelining, SCHEDULES[name])
    loss_fn = (lambda output, target: output.sum()) if training else None
    if name in MULTI_STAGE:
        return cls(built, microbatches, loss_fn=loss_fn, scale_grads=False), sends
    return cls(built[0], microbatches, loss_fn=loss_fn, scale_grads=False), sends


def sendable(split: NetworkSplit, stage: int, expected: Tensor, out: Any, *, traced: bool) -> Tensor:
    """``stage``'s output activation as its boundary sends it: of the shape and dtype the boundary was sized with
    (``expected``; else refused), and contiguous (c10d sends a contiguous buffer: a block may return a view, such as a
    channels-last permute of its input; the copy costs one activation per micro-batch where it is one, nothing
    otherwise). ``traced``: the boundaries came from the network's meta forward (else from its first block's input).

    Example:
        >>> # out = sendable(split, 0, runner._sends[0][0], stage_output, traced=True)
    """
    if not isinstance(out, Tensor) or out.shape != expected.shape or out.dtype != expected.dtype:
        if isinstance(out, Tensor) and out.shape == expected.shape:
            got, carried = str(out.dtype), str(expected.dtype)  # a dtype the boundary was not sized with
        else:
            got = str(list(out.shape)) if isinstance(out, Tensor) else type(out).__name__
            carried = str(list(expected.shape))
        last = f"{split.blocks_name}.{split.plan.blocks(stage).stop - 1}"
        why = (
            ""
            if traced
            else " The network's forward could not run on meta tensors to show the shape and dtype at each boundary,"
            " so each was sized as the hidden state entering the first block: this block list changes it."
        )
        raise HybridConfigError(
            f"pipeline stage {stage} ends with `{last}`, whose output ({got}) is not the {carried} the stage"
            f" boundary carries.{why} Give `pipeline_partition` as a list of block counts that ends stages only"
            " where the hidden state has the shape and dtype entering the first block, or train without pipeline"
            " parallel (`pipeline_parallel_size=1`)."
        )
    return out.contiguous()
