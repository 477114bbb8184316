"""What crosses each pipeline stage boundary, what each block returns, and what one device's forward differentiates,
read off one forward of the unsplit network on meta tensors.

A stage sends the hidden state its last block returns; the next stage substitutes it for the hidden state its first
block takes. torch's ``PipelineStage`` needs the shape and dtype of each in advance (it allocates the receive
buffers), and blocks keep neither: a hierarchical vision transformer (Swin) merges patches at the end of each of its
stages, halving the tokens and doubling the width, and under ``bf16-mixed`` a block of linear layers returns bf16
where its input was fp32 (a transformer's residual sum stays fp32). So each boundary's shape and dtype are read from a
forward of the network as it was before the cut, a copy whose parameters and buffers are meta tensors (no memory, no
compute), on the step's own network inputs, under the step's own autocast: meta tensors take no autocast, so under
autocast the forward runs on fake tensors of the step's device instead (``_torch_compat.fake_tensor_mode``: no
memory either). Where the network's own code between two blocks changes the hidden state's shape (a merge outside the
blocks), a stage cannot end there: the next stage would take the earlier block's output where the forward gives the
changed one; such a cut is refused on every rank, naming where stages may end. A dtype the forward changes between two
blocks is applied by the receiving stage (pipeline/stage.py).

The same forward records what each block returns (:attr:`UnsplitForward.outputs`, tuples included: a decoder layer's
``(hidden, attn_weights)``, a vision stage's ``(hidden, (height, width))``), which the stand-ins for other stages'
blocks return (pipeline/stage.py ``SkippedBlock``); which values a block reads from another block or an input module
outside the hidden state (pipeline/connections.py: a cut between the two is refused); and which parameters one
device's forward uses: a parameter its output does not depend on (a ViT's ``mask_token``, read only when a mask is
passed) gets no gradient on one device either, and the first step's checks (pipeline/checks.py) do not ask one of it.

c10d sends contiguous buffers, and a block may return a view (a channels-last ``permute``): the runner sends a
stage's output contiguous, and :func:`contiguous_gradient` does the same for the gradient sent back.

Cost: one forward on meta (or fake) tensors per rank for each new shape of the network's inputs (when the schedule is
built for them), and a meta copy of the network, made when it is cut. Where the forward cannot run on meta tensors (it
reads values: ``.item()``), every boundary is sized as the hidden state entering the first block, as before blocks
could change it, and a stage whose output has another shape or dtype is refused at the first training step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._hooks import first_tensor, tensors_in
from lightning_hybrid._torch_compat import fake_tensor_mode
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.pipeline.connections import (
    Connection,
    Provenance,
    allowed_cuts,
    check_connections,
    hidden_output,
    record_connections,
)
from lightning_hybrid.pipeline.partition import StagePlan

__all__ = [
    "TensorSpec",
    "UnsplitForward",
    "build_output",
    "contiguous_gradient",
    "detached",
    "map_tensors",
    "meta_copy",
    "to_meta",
    "trace_unsplit_forward",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape and dtype: what a stage boundary carries, or a tensor in a block's output."""

    shape: Shape
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)


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


def template_of(output: Any) -> Any:
    """``output`` with every tensor replaced by its :class:`TensorSpec` (lists, tuples, dicts kept; other values as
    they are: a vision stage's ``(height, width)``, a ``None`` for attention weights not asked for)."""
    return map_tensors(TensorSpec.of)(output)


def build_output(template: Any, device: torch.device, hidden: Optional[Tensor] = None) -> Any:
    """A value of ``template``'s structure, zeros for its tensors (on ``device``); its hidden state (its first
    tensor) is ``hidden`` itself where that has the same shape and dtype (no allocation: the common block that keeps
    the hidden state's shape)."""
    first = [True]

    def make(obj: Any) -> Any:
        if isinstance(obj, TensorSpec):
            is_first, first[0] = first[0], False
            if is_first and hidden is not None and tuple(hidden.shape) == obj.shape and hidden.dtype == obj.dtype:
                return hidden
            return torch.zeros(obj.shape, dtype=obj.dtype, device=device)
        if isinstance(obj, dict):
            made = {k: make(v) for k, v in obj.items()}
            try:
                return type(obj)(**made)
            except Exception:
                return made
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(make(v) for v in obj)
        return obj

    return make(template)


@dataclass(frozen=True)
class UnsplitForward:
    """What one forward of the unsplit network did, on meta (or fake) tensors."""

    entering: tuple[TensorSpec, ...]
    """The hidden state entering each block."""
    leaving: tuple[TensorSpec, ...]
    """The hidden state each block returns (a tuple's first tensor: what a stage sends)."""
    used: frozenset[str]
    """Names (relative to the network) of the parameters the forward's output depends on: those one device's step
    gives a gradient."""
    outputs: tuple[Any, ...] = ()
    """What each block returned, its tensors as :class:`TensorSpec` (see :func:`template_of`)."""
    connections: tuple[Connection, ...] = ()
    """What blocks (and the network's output) read from other blocks or input modules besides the hidden state the
    previous block returns (pipeline/connections.py)."""

    def allowed_cuts(self) -> set[int]:
        """The blocks after which a stage may end: the hidden state keeps its shape up to the next block, and no value
        passed outside the hidden state is made on one side and read on the other."""
        same_shape = {k for k in range(len(self.entering) - 1) if self.leaving[k].shape == self.entering[k + 1].shape}
        return same_shape & allowed_cuts(self.connections, len(self.entering))

    def stage_inputs(self, plan: StagePlan, blocks_name: str) -> list[TensorSpec]:
        """What each stage receives: the hidden state entering stage 0's first block, then the one the previous
        stage's last block returns (what it sends; the receiving stage casts it to the dtype its first block takes
        where the forward changes it between the two). Raises ``HybridConfigError`` where the cut separates a value
        read outside the hidden state from where it is made, or where the forward changes the hidden state's shape
        between a stage's last block and the next stage's first, outside the blocks.

        Example:
            >>> from lightning_hybrid.pipeline.partition import partition_blocks
            >>> spec = lambda *shape: TensorSpec(shape, torch.float32)
            >>> entering, leaving = (spec(4, 64, 16), spec(4, 16, 32)), (spec(4, 16, 32), spec(4, 16, 32))
            >>> trace = UnsplitForward(entering, leaving, frozenset())
            >>> [s.shape for s in trace.stage_inputs(partition_blocks(2, 2), "layers")]
            [(4, 64, 16), (4, 16, 32)]
        """
        allowed = self.allowed_cuts()
        refusal = check_connections(self.connections, plan, blocks_name, allowed)
        if refusal is not None:
            raise HybridConfigError(refusal)
        specs = [self.entering[0]]
        for stage in range(1, len(plan.counts)):
            first = plan.blocks(stage).start
            if self.leaving[first - 1].shape != self.entering[first].shape:
                raise HybridConfigError(self._cut_between_blocks(plan, blocks_name, first, allowed))
            specs.append(self.leaving[first - 1])
        return specs

    def _cut_between_blocks(self, plan: StagePlan, blocks_name: str, first: int, allowed: set[int]) -> str:
        where = (
            f"A stage may end after blocks {sorted(allowed)} (0-based): give `pipeline_partition` as a list of block"
            " counts that cuts there only"
            if allowed
            else "No stage may end anywhere in this block list"
        )
        return (
            f"`pipeline_parallel_size` > 1: the cut {list(plan.counts)} ends a pipeline stage after"
            f" `{blocks_name}.{first - 1}`, whose output has shape {list(self.leaving[first - 1].shape)}, but the"
            f" network's forward changes the hidden state to shape {list(self.entering[first].shape)} before"
            f" `{blocks_name}.{first}`, outside the blocks: the next stage would take the block's output where the"
            f" forward gives the changed hidden state. {where}, move the change into a block, or train without"
            " pipeline parallel (`pipeline_parallel_size=1`)."
        )


def trace_unsplit_forward(
    network: nn.Module,
    blocks_name: str,
    args: tuple,
    kwargs: dict,
    *,
    training: bool,
    inputs: Iterable[str] = (),
    device: Optional[torch.device] = None,
) -> Optional[UnsplitForward]:
    """Run ``network`` (a :func:`meta_copy` of the network before the cut) on meta copies of ``args`` and ``kwargs``,
    recording the hidden state entering and leaving each block of ``blocks_name`` (their first call), what each block
    returns, what blocks read outside the hidden state (``inputs``: the names of the input modules, which only the
    first stage holds) and the parameters its output depends on. Where autocast is on for ``device`` (the step's
    device), the forward runs on fake tensors of that device instead, so that autocast gives each tensor the dtype the
    step computes it in. None where the forward fails (it reads values) or does not call every block.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Linear(2, 3))
        >>> _ = net[2].weight.requires_grad_(False)
        >>> trace = trace_unsplit_forward(meta_copy(net), "1", (torch.zeros(5, 8),), {}, training=True)
        >>> [s.shape for s in trace.entering], [s.shape for s in trace.leaving]
        ([(5, 4), (5, 4)], [(5, 4), (5, 2)])
        >>> "2.bias" in trace.used, "2.weight" in trace.used  # frozen: one device gives it no gradient either
        (True, False)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     trace = trace_unsplit_forward(meta_copy(net), "1", (torch.zeros(5, 8),), {}, training=True,
        ...                                   device=torch.device("cpu"))
        >>> trace.leaving[0].dtype  # what the step's autocast computes
        torch.bfloat16
    """
    blocks = network.get_submodule(blocks_name)
    n = len(blocks)
    entering: list[Optional[TensorSpec]] = [None] * n
    leaving: list[Optional[TensorSpec]] = [None] * n
    outputs: list[Any] = [None] * n

    def enter(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found = first_tensor(args, kwargs)
            if entering[i] is None and found is not None:
                entering[i] = TensorSpec.of(found[1])

        return hook

    def leave(i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            found = hidden_output(output)
            if leaving[i] is None and found is not None:
                leaving[i], outputs[i] = TensorSpec.of(found), template_of(output)

        return hook

    provenance = Provenance()
    modules = dict(network.named_modules())
    connections, read_output, handles = record_connections(
        provenance, list(blocks), {name: modules[name] for name in inputs if name in modules}
    )
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(block.register_forward_hook(leave(i)))
    was_training = network.training
    network.train(training)
    fake = device is not None and torch.is_autocast_enabled(device.type)
    try:
        with torch.enable_grad(), fake_tensor_mode() if fake else nullcontext():
            call, tensors = _call_on(network, args, kwargs, device if fake else None)
            with provenance:
                out = call()
            read_output(out)
            used = _differentiated(tensors, tensors_in(out))
    except Exception:  # a forward that reads values cannot run on meta (or fake) tensors: no trace
        return None
    finally:
        network.train(was_training)
        for handle in handles:
            handle.remove()
    if any(s is None for s in entering) or any(s is None for s in leaving):
        return None
    return UnsplitForward(tuple(entering), tuple(leaving), used, tuple(outputs), tuple(connections))  # type: ignore[arg-type]


def _call_on(
    network: nn.Module, args: tuple, kwargs: dict, device: Optional[torch.device]
) -> tuple[Callable[[], Any], dict[str, Tensor]]:
    """The network's forward on meta copies of ``args`` and ``kwargs`` (its own meta parameters and buffers), or,
    given ``device`` (inside the fake mode), on fake tensors of that device for all of them; and the parameters the
    call uses, by name (tied names sharing one tensor)."""
    if device is None:
        tensors = dict(network.named_parameters(remove_duplicate=False))
        return (lambda: network(*to_meta(args), **to_meta(kwargs))), tensors
    fakes: dict[int, Tensor] = {}

    def fake(t: Tensor) -> Tensor:
        if id(t) not in fakes:
            made = torch.empty(t.shape, dtype=t.dtype, device=device)
            fakes[id(t)] = made.requires_grad_(t.requires_grad) if t.is_floating_point() else made
        return fakes[id(t)]

    tensors = {name: fake(p) for name, p in network.named_parameters(remove_duplicate=False)}
    state = {**tensors, **{name: fake(b) for name, b in network.named_buffers(remove_duplicate=False)}}
    as_fake = map_tensors(lambda t: torch.empty_like(t, device=device))
    return (lambda: torch.func.functional_call(network, state, as_fake(args), as_fake(kwargs))), tensors


def _differentiated(tensors: dict[str, Tensor], outputs: list[Tensor]) -> frozenset[str]:
    """Names of ``tensors`` (the parameters the forward used) in the autograd graph of ``outputs`` (a walk from
    their ``grad_fn``)."""
    names: dict[int, list[str]] = {}
    for name, p in tensors.items():
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
