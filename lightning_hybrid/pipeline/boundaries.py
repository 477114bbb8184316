"""What crosses each pipeline stage boundary, and what one device's forward differentiates, read off one forward of
the unsplit network on meta tensors.

A stage sends the hidden state its last block returns; the next stage substitutes it for the hidden state its first
block takes. torch's ``PipelineStage`` needs the shape of each in advance (it allocates the receive buffers), and
blocks need not keep the hidden state's shape: a hierarchical vision transformer (Swin) merges patches at the end of
each of its stages, halving the tokens and doubling the width. So each boundary's shape is read from a forward of the
network as it was before the cut, a copy whose parameters and buffers are meta tensors (no memory, no compute), on
the step's own network inputs. Where the network's own code between two blocks changes the hidden state's shape (a
merge outside the blocks), a stage cannot end there: the next stage would take the earlier block's output where the
forward gives the changed one; such a cut is refused on every rank, naming where stages may end.

The same forward tells which parameters one device's forward uses: a parameter its output does not depend on (a ViT's
``mask_token``, read only when a mask is passed) gets no gradient on one device either, and the first step's checks
(pipeline/verify.py) do not ask one of it.

c10d sends contiguous buffers, and a block may return a view (a channels-last ``permute``): the runner sends a
stage's output contiguous, and :func:`contiguous_gradient` does the same for the gradient sent back.

Cost: one forward on meta tensors per rank for each new shape of the network's inputs (when the schedule is built for
them), and a meta copy of the network, made when it is cut. Where the forward cannot run on meta tensors (it reads
values: ``.item()``), every boundary is sized as the hidden state entering the first block, as before blocks could
change it, and a stage whose output has another shape is refused at the first training step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._hooks import first_tensor, tensors_in
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.pipeline.partition import StagePlan

__all__ = [
    "UnsplitForward",
    "contiguous_gradient",
    "detached",
    "map_tensors",
    "meta_copy",
    "to_meta",
    "trace_unsplit_forward",
]

Shape = tuple[int, ...]


def meta_copy(module: nn.Module, keep: Iterable[object] = ()) -> Optional[nn.Module]:
    """A deep copy of ``module`` with every parameter and buffer on the meta device, sharing no storage with it (tied
    weights held elsewhere keep their real tensors); None where the module cannot be copied. ``keep``: objects the
    copy refers to rather than copies (the Trainer and mesh a LightningModule refers to)."""
    memo: dict[int, Any] = {id(obj): obj for obj in keep if obj is not None}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # e.g. a module holding a handle that cannot be copied: attributes then are not readable
        return None


def map_tensors(fn: Callable[[Tensor], Tensor]) -> Callable[[Any], Any]:
    """``fn`` applied to every tensor in a call's arguments or outputs (lists, tuples, dicts; a dict subclass such as
    transformers' ``ModelOutput`` keeps its type where it can be rebuilt)."""

    def apply(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return fn(obj)
        if isinstance(obj, dict):
            mapped = {k: apply(v) for k, v in obj.items()}
            try:
                return type(obj)(**mapped)
            except Exception:
                return mapped
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(apply(v) for v in obj)
        return obj

    return apply


to_meta = map_tensors(lambda t: torch.empty_like(t, device="meta"))
"""A call's arguments with every tensor replaced by a meta tensor of its shape and dtype."""

detached = map_tensors(lambda t: t.detach())
"""A call's arguments with every tensor detached from the graph that made it."""


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, received: Tensor) -> Tensor:
        return received.view_as(received)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_gradient(received: Tensor) -> Tensor:
    """``received`` (an activation a stage received), whose gradient the backward hands on contiguous: c10d sends a
    contiguous buffer, and a block that starts with a view of its input (``x.permute(0, 3, 1, 2)``) gives a strided
    gradient where the zero-bubble schedules take it from ``torch.autograd.grad`` (a full backward lays ``.grad``
    out like the input). Costs a copy of the gradient where it is strided, nothing otherwise.

    Example:
        >>> x = torch.zeros(2, 3, 4, requires_grad=True)
        >>> torch.autograd.grad(contiguous_gradient(x).permute(2, 0, 1).sum(), x)[0].is_contiguous()
        True
    """
    return _ContiguousGradient.apply(received)


@dataclass(frozen=True)
class UnsplitForward:
    """What one forward of the unsplit network did, on meta tensors."""

    entering: tuple[Shape, ...]
    """The shape of the hidden state entering each block."""
    leaving: tuple[Shape, ...]
    """The shape of the hidden state each block returns (a tuple's first element: what a stage sends)."""
    used: frozenset[str]
    """Names (relative to the network) of the parameters the forward's output depends on: those one device's step
    gives a gradient."""

    def stage_inputs(self, plan: StagePlan, blocks_name: str) -> list[Shape]:
        """The shape of the hidden state entering each stage's first block (stage 0's included): what each boundary
        carries. Raises ``HybridConfigError`` where the forward changes the shape between a stage's last block and
        the next stage's first, outside the blocks.

        Example:
            >>> from lightning_hybrid.pipeline.partition import partition_blocks
            >>> trace = UnsplitForward(((4, 64, 16), (4, 16, 32)), ((4, 16, 32), (4, 16, 32)), frozenset())
            >>> trace.stage_inputs(partition_blocks(2, 2), "layers")
            [(4, 64, 16), (4, 16, 32)]
        """
        shapes = [self.entering[0]]
        for stage in range(1, len(plan.counts)):
            first = plan.blocks(stage).start
            if self.leaving[first - 1] != self.entering[first]:
                raise HybridConfigError(self._cut_between_blocks(plan, blocks_name, first))
            shapes.append(self.entering[first])
        return shapes

    def _cut_between_blocks(self, plan: StagePlan, blocks_name: str, first: int) -> str:
        ends = [k for k in range(len(self.entering) - 1) if self.leaving[k] == self.entering[k + 1]]
        where = (
            f"A stage may end after blocks {ends} (0-based): give `pipeline_partition` as a list of block counts"
            " that cuts there only"
            if ends
            else "No stage may end anywhere in this block list"
        )
        return (
            f"`pipeline_parallel_size` > 1: the cut {list(plan.counts)} ends a pipeline stage after"
            f" `{blocks_name}.{first - 1}`, whose output has shape {list(self.leaving[first - 1])}, but the network's"
            f" forward changes the hidden state to shape {list(self.entering[first])} before `{blocks_name}.{first}`,"
            " outside the blocks: the next stage would take the block's output where the forward gives the changed"
            f" hidden state. {where}, move the change into a block, or train without pipeline parallel"
            " (`pipeline_parallel_size=1`)."
        )


def trace_unsplit_forward(
    network: nn.Module, blocks_name: str, args: tuple, kwargs: dict, *, training: bool
) -> Optional[UnsplitForward]:
    """Run ``network`` (a :func:`meta_copy` of the network before the cut) on meta copies of ``args`` and ``kwargs``,
    recording the hidden state entering and leaving each block of ``blocks_name`` (their first call) and the
    parameters its output depends on. None where the forward fails on meta tensors (it reads values) or does not
    call every block.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Linear(2, 3))
        >>> _ = net[2].weight.requires_grad_(False)
        >>> trace = trace_unsplit_forward(meta_copy(net), "1", (torch.zeros(5, 8),), {}, training=True)
        >>> trace.entering, trace.leaving
        (((5, 4), (5, 4)), ((5, 4), (5, 2)))
        >>> "2.bias" in trace.used, "2.weight" in trace.used  # frozen: one device gives it no gradient either
        (True, False)
    """
    blocks = network.get_submodule(blocks_name)
    n = len(blocks)
    entering: list[Optional[Shape]] = [None] * n
    leaving: list[Optional[Shape]] = [None] * n

    def enter(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found = first_tensor(args, kwargs)
            if entering[i] is None and found is not None:
                entering[i] = tuple(found[1].shape)

        return hook

    def leave(i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            found = output if isinstance(output, Tensor) else next(iter(tensors_in(output)), None)
            if leaving[i] is None and found is not None:
                leaving[i] = tuple(found.shape)

        return hook

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(block.register_forward_hook(leave(i)))
    was_training = network.training
    network.train(training)
    try:
        with torch.enable_grad():
            out = network(*to_meta(args), **to_meta(kwargs))
    except Exception:  # a forward that reads values cannot run on meta tensors: no trace
        return None
    finally:
        network.train(was_training)
        for handle in handles:
            handle.remove()
    if any(s is None for s in entering) or any(s is None for s in leaving):
        return None
    return UnsplitForward(tuple(entering), tuple(leaving), _differentiated(network, tensors_in(out)))  # type: ignore[arg-type]


def _differentiated(network: nn.Module, outputs: list[Tensor]) -> frozenset[str]:
    """Names of ``network``'s parameters in the autograd graph of ``outputs`` (a walk from their ``grad_fn``)."""
    names: dict[int, list[str]] = {}
    for name, p in network.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    seen: set[Any] = set()
    # an output that is a parameter itself has no grad_fn
    used: set[str] = {n for t in outputs if t.grad_fn is None for n in names.get(id(t), ())}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf, a parameter if it is ours
        if variable is not None:
            used.update(names.get(id(variable), ()))
        stack.extend(fn for fn, _ in node.next_functions)
    return frozenset(used)
