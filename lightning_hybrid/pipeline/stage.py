"""Cutting a network into pipeline stages without rewriting its ``forward``.

A stage runs the network's own ``forward`` with three changes made through module swaps and hooks:

* blocks held by other stages are replaced by a stand-in (:class:`SkippedBlock`) that returns what the block returns
  (its structure, zeros of its shapes; tuples included), so the block loop is unchanged;
* on a stage that is not the first, the input modules (embeddings) are replaced by stubs that only produce a tensor
  of the right shape, and the first block of the stage receives the activation sent by the previous stage instead;
* on a stage that is not the last, the forward stops right after the stage's last block (:class:`StageBoundary`).

This is what lets a single-device ``training_step`` train under pipeline parallel unchanged, and what torch's
``pipelining`` does not do for us: its ``pipeline()`` tracer needs a traceable model, its manual mode a model whose
forward tolerates missing modules (torchtitan writes its models that way).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import first_tensor, map_first_input, tensors_in
from lightning_hybrid._torch_compat import module_children
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.pipeline.boundaries import (
    UnsplitForward,
    build_output,
    contiguous_gradient,
    map_tensors,
    meta_copy,
    template_of,
    to_meta,
)
from lightning_hybrid.pipeline.connections import hidden_output
from lightning_hybrid.pipeline.order import _call_order, _Slot, call_order, check_one_block_list, io_slots
from lightning_hybrid.pipeline.partition import StagePlan

if TYPE_CHECKING:
    from lightning_hybrid.pipeline.step_data import StepContext

__all__ = [
    "NetworkSplit",
    "SkippedBlock",
    "StageBoundary",
    "StageModule",
    "call_order",
    "check_one_block_list",
    "io_slots",
    "split_network",
]


class StageBoundary(BaseException):
    """Raised after a stage's last block to end the network's forward early; carries the block's output.

    A ``BaseException``, as ``GeneratorExit`` is: control flow, not an error. A network whose forward wraps its blocks
    in ``try/except Exception`` (to re-raise its own error) would otherwise catch the stop and fail the step."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output


class _ReadsAttributesOf(nn.Module):
    """A stand-in whose attributes it lacks are read from ``self.__dict__["_shadow"]`` (the module it replaces, or a
    meta copy of it): a network's forward may read attributes of modules another stage holds (torch's
    ``nn.TransformerEncoder`` reads ``self.layers[0].self_attn.batch_first``, ViT its patch projection's dtype)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("_shadow")
            if shadow is None:
                raise
            return getattr(shadow, name)

    def _meta_forward(self, args: tuple, kwargs: dict, made_of: Callable[[Any], Any] = lambda out: out) -> Any:
        """``made_of`` what the module's meta copy returns on meta copies of ``args`` (cached in
        ``self.__dict__["_meta_outputs"]`` per input signature), or None where there is no copy or it cannot run on
        meta tensors."""
        shadow = self.__dict__["_shadow"]
        if shadow is None:
            return None
        key = _signature((args, kwargs))
        cache = self.__dict__["_meta_outputs"]
        if key is None or key not in cache:
            try:
                with torch.no_grad():
                    made = made_of(shadow(*to_meta(args), **to_meta(kwargs)))
            except Exception:  # a forward that reads values (``.item()``, data-dependent shapes) cannot run on meta
                made = None
            if key is None:
                return made
            cache[key] = made
        return cache[key]


class SkippedBlock(_ReadsAttributesOf):
    """A block that another stage holds: returns what the block returns, without parameters or compute.

    The network's forward runs the stand-ins of the blocks before a stage's first one (on values that the received
    activation then replaces) and unpacks, indexes and reads what they return as it does the block's own output: a
    decoder layer's ``(hidden, attn_weights)``, a vision stage's ``(hidden, (height, width))`` whose sizes the forward
    hands to the next stage. So the stand-in returns the block's output as the unsplit network's trace recorded it
    for the step's inputs (``templates``, shared with the split: pipeline/boundaries.py), zeros for its tensors and
    its hidden-state input in place of the hidden state where shape and dtype agree; where the trace is not known
    (the network's forward reads values), from a forward of the block's meta copy on meta copies of its inputs;
    where that cannot run either, its hidden-state input alone.

    ``module``: the block it replaces, whose attributes stay readable; a block another rank holds is kept as a meta
    copy (``held=False``), one this rank holds (another local stage's) as itself."""

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        *,
        held: bool = False,
        index: int = -1,
        templates: Optional[dict[int, Any]] = None,
    ) -> None:
        super().__init__()
        self.__dict__["_shadow"] = module if held or module is None else meta_copy(module)
        self.__dict__["_held"] = held
        self.__dict__["_index"] = index
        self.__dict__["_templates"] = templates if templates is not None else {}
        self.__dict__["_meta_outputs"] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        found = first_tensor(args, kwargs)
        if found is None:
            raise HybridConfigError("A skipped pipeline block found no hidden-state tensor among its inputs.")
        hidden = found[1]
        template = self.__dict__["_templates"].get(self.__dict__["_index"])
        if template is None and not self.__dict__["_held"]:
            template = self._meta_forward(args, kwargs, template_of)
        return hidden if template is None else build_output(template, hidden.device, hidden)


class InputStub(_ReadsAttributesOf):
    """Stands in for an input module held by the first stage: returns zeros shaped like that module's output, so the
    network's forward runs on until the stage's first block, where the received activation replaces them.

    The module's attributes stay readable (a forward may read ``self.embeddings.patch_embeddings.projection.weight
    .dtype`` or ``.num_patches`` before calling it): they come from a copy of the module whose parameters and buffers
    are on the meta device (no memory, no gradients, not a submodule). The output's shape and dtype come from running
    that copy on meta inputs, so they are the module's own for any module; where that forward cannot run on meta
    (it reads values), the shape is inferred from the kind of module (embedding, linear, or the input's shape)."""

    _quick_table = True
    """Whether an output's shape, dtype and device follow from the inputs' and the stub's dtype (see ``forward``)."""

    def __init__(self, module: nn.Module, *, shadow: bool = True) -> None:
        super().__init__()
        self.dtype = next(module.parameters()).dtype
        # keep only sizes and a meta copy, not the module: the point is to free its parameters on this stage
        if isinstance(module, nn.Embedding):
            self.kind, self.size = "append", module.embedding_dim
        elif isinstance(module, nn.Linear):
            self.kind, self.size = "replace_last", module.out_features
        else:
            self.kind, self.size = "same", 0
        # in __dict__, not _modules: its (meta) parameters are no part of this stage
        self.__dict__["_shadow"] = meta_copy(module) if shadow else None
        self.__dict__["_meta_outputs"] = {}
        self.__dict__["_quick"] = {}  # (dtype, inputs' shape, dtype, device) -> the output's shape, dtype, device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the common call (tensors in, one tensor out) from a table: it runs per micro-batch on every later stage
        quick = None
        if self._quick_table and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            quick = (self.dtype, *((a.shape, a.dtype, a.device) for a in args))
            made = self.__dict__["_quick"].get(quick)
            if made is not None:
                return torch.zeros(made[0], dtype=made[1], device=made[2])
        out = self._stub_output(args, kwargs)
        if quick is not None and isinstance(out, torch.Tensor):
            self.__dict__["_quick"][quick] = (out.shape, out.dtype, out.device)
        return out

    def _stub_output(self, args: tuple, kwargs: dict) -> Any:
        device = next((t.device for t in tensors_in((args, kwargs))), torch.device("cpu"))
        meta = self._meta_forward(args, kwargs)
        if meta is not None:
            # floating outputs in the stub's dtype: the strategy sets it when '-true' precisions convert the module
            floating = self.dtype if self.dtype.is_floating_point else None

            def zeros(t: torch.Tensor) -> torch.Tensor:
                dtype = floating if floating is not None and t.is_floating_point() else t.dtype
                return torch.zeros(t.shape, dtype=dtype, device=device)

            return map_tensors(zeros)(meta)
        x = args[0] if args else first_tensor(args, kwargs)[1]  # type: ignore[index]
        shape = {"append": (*x.shape, self.size), "replace_last": (*x.shape[:-1], self.size)}.get(self.kind, x.shape)
        return torch.zeros(shape, dtype=self.dtype, device=x.device)


def _signature(obj: Any) -> Optional[tuple]:
    """A hashable key of a call's arguments: tensors by shape and dtype, plain values as they are; None where an
    argument is neither (the meta forward then runs at every call)."""
    if isinstance(obj, torch.Tensor):
        return ("t", tuple(obj.shape), obj.dtype)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("v", obj)
    if isinstance(obj, dict):
        items = [(k, _signature(v)) for k, v in obj.items()]
        return None if any(v is None for _, v in items) else ("d", tuple(items))
    if isinstance(obj, (list, tuple)):
        items = [_signature(v) for v in obj]
        return None if any(v is None for v in items) else ("l", tuple(items))
    return None


class _LiveInputStub(InputStub):
    """An input stub for an input module this rank holds (the first stage on the rank of a later one): the output
    dtype is the module's at each call, as a stub built per forward had (FSDP2 swaps in parameters of another dtype
    while a module is unsharded)."""

    _quick_table = False  # the held module's dtype decides, read at every call

    def __init__(self, module: nn.Module) -> None:
        # no meta copy: attributes are read from the held module itself
        super().__init__(module, shadow=False)
        self.__dict__["_shadow"] = module
        self.__dict__["held"] = module  # not a submodule: its parameters belong to the first stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.dtype = next(self.__dict__["held"].parameters()).dtype
        return super().forward(*args, **kwargs)

    def _meta_forward(self, args: tuple, kwargs: dict, made_of: Callable[[Any], Any] = lambda out: out) -> Any:
        return None  # the held module is real (and may be sharded): its output shape is inferred by kind


class OutputStub(nn.Module):
    """Stands in for an output module (norm, head) held by the last stage; never reached, since earlier stages stop
    at their last block."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("lightning-hybrid: an output module ran on a pipeline stage that does not hold it.")


@dataclass
class NetworkSplit:
    """This rank's share of the network: real blocks for its stages, stubs elsewhere."""

    network: nn.Module
    blocks: nn.ModuleList
    plan: StagePlan
    pipeline_rank: int
    input_slots: list[_Slot] = field(default_factory=list)
    output_slots: list[_Slot] = field(default_factory=list)
    placed: str = ""
    """How the modules outside the blocks whose call order was not known were given to a stage (for errors)."""
    blocks_name: str = "blocks"
    """The block list's name relative to the network."""
    unsplit: Optional[nn.Module] = None
    """A copy of the network taken before the cut, its parameters and buffers on the meta device: its forward shows
    the shape crossing each stage boundary and the parameters one device differentiates (pipeline/boundaries.py).
    None where it could not be copied, or holds tensor-parallel parameters already."""
    input_names: tuple[str, ...] = ()
    """The input modules (names relative to the network), held by the first stage, stand-ins elsewhere: what a later
    stage reads of their output is refused (pipeline/connections.py)."""
    templates: dict[int, Any] = field(default_factory=dict)
    """What each block returns for the schedule's current inputs (pipeline/boundaries.py ``UnsplitForward.outputs``),
    shared with the stand-ins for other stages' blocks (:class:`SkippedBlock`), which return it."""
    entry_dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    """Per stage, the dtype its first block takes where the forward casts the hidden state between the previous
    stage's last block and it: the received activation is cast to it."""
    # what `active` needs per stage, built on first use (a forward action is per micro-batch: keep it cheap)
    _swaps: dict[int, list[tuple[dict, str, nn.Module]]] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.plan.counts)

    def cast_unsplit(self, dtype: torch.dtype, buffers: bool) -> None:
        """Give the meta copy's floating parameters (and, with ``buffers``, buffers) ``dtype``, as a '-true' precision
        casts the module (ZeRO-3's FSDP2 casts parameters only, for compute), so that the trace shows the dtypes the
        step computes in."""
        if self.unsplit is None:
            return
        if buffers:
            self.unsplit.to(dtype=dtype)
            return
        for p in self.unsplit.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)

    def learn(self, trace: Optional[UnsplitForward]) -> None:
        """Take what the unsplit network's trace for the schedule's inputs shows (None: not known): what each block
        returns, for the stand-ins, and the dtype each stage's first block takes."""
        self.templates.clear()
        self.entry_dtypes.clear()
        if trace is None:
            return
        self.templates.update(enumerate(trace.outputs))
        for stage in range(1, self.num_stages):
            first = self.plan.blocks(stage).start
            if trace.entering[first].dtype != trace.leaving[first - 1].dtype:
                self.entry_dtypes[stage] = trace.entering[first].dtype

    def local_stages(self) -> list[int]:
        return self.plan.stages_of(self.pipeline_rank)

    def stage_modules(self, stage: int) -> list[nn.Module]:
        """The modules whose parameters belong to ``stage`` (for its optimizer-facing ``StageModule``)."""
        modules: list[nn.Module] = [self.blocks[i] for i in self.plan.blocks(stage)]
        if stage == 0:
            modules += [s.module for s in self.input_slots]
        if stage == self.num_stages - 1:
            modules += [s.module for s in self.output_slots]
        return modules

    @contextmanager
    def active(self, stage: int) -> Generator[None, None, None]:
        """While the network's forward runs for ``stage``: only its blocks compute, and off the first stage the input
        modules are stubs. (Receiving the activation and stopping after the stage's last block are the hooks of
        :meth:`attached`.)"""
        swaps = self._swaps.get(stage)
        if swaps is None:
            swaps = self._swaps[stage] = self._stage_swaps(stage)
        # read the originals now: activation checkpointing or FSDP may have replaced modules since the first call
        originals = [table[key] for table, key, _ in swaps]
        for table, key, replacement in swaps:
            table[key] = replacement
        try:
            yield
        finally:
            for (table, key, _), original in zip(swaps, originals):
                table[key] = original

    def _stage_swaps(self, stage: int) -> list[tuple[dict, str, nn.Module]]:
        """Module swaps for ``stage``: other chunks on this rank (interleaved) are stand-ins; off the first stage, the
        input modules (held here when the first stage lives on this rank too: v-shaped schedules) become stubs.
        Built once per stage."""
        children = module_children(self.blocks)
        swaps: list[tuple[dict, str, nn.Module]] = [
            (children, str(i), SkippedBlock(children[str(i)], held=True, index=i, templates=self.templates))
            for s in self.local_stages()
            if s != stage
            for i in self.plan.blocks(s)
        ]
        if stage != 0:
            swaps += [
                (module_children(slot.parent), slot.attr, _LiveInputStub(slot.module)) for slot in self.input_slots
            ]
        return swaps

    @contextmanager
    def attached(self, step: StepContext, split_backward: bool = True) -> Generator[None, None, None]:
        """For one step: on the first block of each of this rank's stages but the first, a forward pre-hook that
        substitutes the activation ``step.active`` received; on the last block of each but the last, a forward hook
        that stops the forward (:class:`StageBoundary`). Each acts only while its stage is ``step.active``.
        Registered for the step, so they are the modules' last hooks: other pre-hooks (sequence-parallel re-layout)
        run before the substitution, other forward hooks before the stop. ``split_backward``: the schedule takes
        input gradients from ``torch.autograd.grad`` (zero-bubble), so the received activation hands its gradient
        on contiguous (:func:`contiguous_gradient`); a full backward lays ``.grad`` out like the (contiguous)
        received buffer already, and the per-micro-batch autograd function is left out."""
        blocks = module_children(self.blocks)
        handles = []
        for stage in self.local_stages():
            own = self.plan.blocks(stage)
            if stage != 0:
                receive = _receiver(step, stage, split_backward, self.entry_dtypes.get(stage))
                handles.append(blocks[str(own.start)].register_forward_pre_hook(receive, with_kwargs=True))
            if stage != self.num_stages - 1:
                handles.append(blocks[str(own.stop - 1)].register_forward_hook(_stopper(step, stage)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _receiver(step: StepContext, stage: int, split_backward: bool, dtype: Optional[torch.dtype] = None) -> Callable:
    def received(_: torch.Tensor) -> torch.Tensor:
        tensor: torch.Tensor = step.active[1]  # type: ignore[index]
        tensor = contiguous_gradient(tensor) if split_backward else tensor
        # where the forward casts the hidden state between the two stages' blocks: the cast, in autograd (its
        # gradient is cast back to the dtype the previous stage sent)
        return tensor if dtype is None else tensor.to(dtype)

    substitute = map_first_input(received)

    def receive(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        active = step.active
        return substitute(module, args, kwargs) if active is not None and active[0] == stage else None

    return receive


def _stopper(step: StepContext, stage: int) -> Callable:
    def stop(module: nn.Module, args: Any, output: Any) -> None:
        active = step.active
        if active is not None and active[0] == stage:
            _raise_boundary(module, args, output)

    return stop


def _raise_boundary(module: nn.Module, args: Any, output: Any) -> None:
    raise StageBoundary(hidden_output(output))  # type: ignore[arg-type]


def split_network(
    network: nn.Module,
    blocks_rel: str,
    plan: StagePlan,
    pipeline_rank: int,
    *,
    root: Optional[nn.Module] = None,
    keep: Sequence[object] = (),
) -> NetworkSplit:
    """Replace, in place, every block, input and output module this rank does not hold by a stub.

    ``root``: the LightningModule, whose ``example_input_array`` (if any) shows on which side of the block list
    the forward calls each module (:func:`call_order`). ``keep``: objects the network refers to that its meta copy
    (``NetworkSplit.unsplit``) shares rather than copies (the Trainer and mesh of a LightningModule network).

    Example:
        >>> # split = split_network(gpt, "h", partition_blocks(4, 2), pipeline_rank=1)  # keeps h.2, h.3, ln_f, lm_head
    """
    blocks = network.get_submodule(blocks_rel)
    assert isinstance(blocks, (nn.ModuleList, nn.Sequential))
    check_one_block_list(network, blocks_rel)
    order, placed = _call_order(network, blocks_rel, root)
    inputs, outputs = io_slots(network, blocks_rel, order)
    # a copy already split over tensor parallel (the user's configure_model) would run its collectives on meta
    tensor_parallel = any(isinstance(p, DTensor) for p in network.parameters())
    unsplit = None if tensor_parallel else meta_copy(network, keep)
    names = {id(m): n for n, m in network.named_modules()}
    split = NetworkSplit(
        network, blocks, plan, pipeline_rank, inputs, outputs, placed=placed, blocks_name=blocks_rel, unsplit=unsplit,
        input_names=tuple(names[id(slot.module)] for slot in inputs),
    )  # fmt: skip
    mine = split.local_stages()
    held = {i for s in mine for i in plan.blocks(s)}
    children = module_children(blocks)
    for i in range(len(blocks)):
        if i not in held:
            children[str(i)] = SkippedBlock(children[str(i)], index=i, templates=split.templates)
    if 0 not in mine:
        for slot in inputs:
            setattr(slot.parent, slot.attr, InputStub(slot.module))
        split.input_slots = []
    if split.num_stages - 1 not in mine:
        for slot in outputs:
            setattr(slot.parent, slot.attr, OutputStub())
        split.output_slots = []
    return split


class StageModule(nn.Module):
    """What ``torch.distributed.pipelining.PipelineStage`` runs for one stage: its ``parameters()`` are exactly the
    stage's own (zero-bubble schedules split weight and input gradients by them), and its ``forward`` runs the
    network's forward restricted to this stage for the step in ``context`` (set by the runner for each step)."""

    def __init__(self, stage: int, parts: list[nn.Module]) -> None:
        super().__init__()
        self.stage = stage
        self.parts = nn.ModuleList(parts)
        self.context: Optional[StepContext] = None

    def forward(self, *received: torch.Tensor) -> Any:
        """``received``: the first stage's micro-batch index, or the activations the previous stage sent (one per
        network call of the step)."""
        step = self.context
        if step is None:
            raise RuntimeError("lightning-hybrid: a pipeline stage ran outside a pipeline step.")
        return step.run_stage(step, self.stage, received)
