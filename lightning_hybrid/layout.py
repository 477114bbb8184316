"""The parallel layout as plain data: as asked for and as resolved against the world size, checked.

:class:`LayoutRequest` is the layout as asked for, the one definition of the sizes and their defaults (and the
branch of ``HybridStrategy``'s option tree that holds the tensor-parallel, pipeline and ZeRO sections,
``lightning_hybrid/options.py``); :class:`ParallelLayout` is the layout once the world size is known. Pure Python,
like ``config``: every rank runs the same checks on the same numbers and raises the same
:class:`~lightning_hybrid.HybridConfigError` before any collective exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, Union

from lightning_hybrid.config import (
    SECTIONS,
    HybridConfigError,
    PipelineOptions,
    TensorParallelOptions,
    ZeroOptions,
    check_positive_int,
    check_sizes,
    flat_argument,
)

__all__ = ["LayoutRequest", "ParallelLayout", "check_auto_layout", "check_compile"]


@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """The layout as asked for, before the world size is known: validated on construction (on every rank alike,
    collective-free), completed by :meth:`resolve`.

    Example:
        >>> LayoutRequest(tensor_parallel_size=2, pipeline_parallel_size=2).resolve(8).data_parallel_size
        2
    """

    tensor_parallel_size: int = 1
    """Ranks that split each layer's weights (DTensor): the innermost mesh dimension, consecutive ranks, so keep it
    within a node."""
    pipeline_parallel_size: int = 1
    """Ranks that split the stack of blocks into stages (the outermost mesh dimension)."""
    data_parallel_size: Union[int, Literal["auto"]] = "auto"
    """Model replicas that see different data; ZeRO shards over them. ``"auto"``: the world size // (tensor x pipeline
    x context parallel sizes)."""
    zero_stage: int = 1
    """0 replicates the model; 1 shards optimizer state; 2 also gradients; 3 also parameters (FSDP2), over the
    data-parallel ranks."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence between tensor-parallel regions (Megatron-SP); needs tensor
    parallel."""
    expert_parallel_size: int = 1
    """Ranks of the data-parallel dimension that split each mixture-of-experts layer's experts (consecutive
    data-parallel ranks); the dense weights stay data parallel over all of them (docs/expert-parallel.md)."""
    context_parallel_size: int = 1
    """Ranks that split each sample's sequence, attention exact (docs/context-parallel.md). They hold the same weights
    as the replicas do: the mesh's ``data`` dimension spans both (``ParallelLayout.data_dimension_size``), and
    gradients are averaged and ZeRO-sharded over all of it, as Megatron's data-and-context-parallel group."""
    tensor_parallel: TensorParallelOptions = field(default_factory=TensorParallelOptions)
    """How layers are split over the tensor-parallel ranks."""
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    """How the blocks are cut into stages and scheduled (used when ``pipeline_parallel_size`` > 1)."""
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    """How gradients and optimizer state are reduced and sharded over the data-parallel ranks."""

    def __post_init__(self) -> None:
        check_sizes(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel,
            expert_parallel_size=self.expert_parallel_size,
            context_parallel_size=self.context_parallel_size,
        )
        self.pipeline.check_stages(self.pipeline_parallel_size)
        _check_context_parallel(self)

    def resolve(self, world_size: int) -> ParallelLayout:
        """Validate the sizes against the world size and fill in ``data_parallel_size="auto"`` and the micro-batch
        count."""
        check_positive_int("world_size", world_size)
        tp, pp, cp = self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size
        # the context-parallel size joins the product only when used, so the messages without it stay as they were
        names, sizes = ("tensor_parallel_size x pipeline_parallel_size", f"{tp} x {pp}")
        if cp > 1:
            names, sizes = f"{names} x context_parallel_size", f"{sizes} x {cp}"
        model = tp * pp * cp
        if world_size % model != 0:
            raise HybridConfigError(
                f"The world size ({world_size}) is not divisible by {names} ({sizes} = {model}). Change"
                f" `{names.replace(' x ', '`/`')}`, or launch a multiple of {model} processes (devices x num_nodes)."
            )
        if self.data_parallel_size == "auto":
            dp = world_size // model
        else:
            dp = self.data_parallel_size
            if model * dp != world_size:
                raise HybridConfigError(
                    f"{names} x data_parallel_size = {sizes} x {dp} = {model * dp}, but the world size is"
                    f" {world_size}. Set `data_parallel_size='auto'` (= {world_size // model}) or change the sizes so"
                    f" that their product is {world_size}."
                )
        _check_expert_parallel(self.expert_parallel_size, dp, self.sequence_parallel)
        return ParallelLayout(
            world_size=world_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel,
            expert_parallel_size=self.expert_parallel_size,
            context_parallel_size=cp,
            tensor_parallel=self.tensor_parallel,
            pipeline=replace(self.pipeline, num_microbatches=self.pipeline.num_microbatches or pp),
            zero=self.zero,
        )


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the world of processes is split: tensor x pipeline x data parallel, and the ZeRO stage over data. The
    fields of :class:`LayoutRequest` (documented there, with their defaults), resolved against the world size: the
    data-parallel size and the micro-batch count filled in. Made by :meth:`LayoutRequest.resolve`.

    Example:
        >>> layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
        >>> layout.data_parallel_size
        2
    """

    world_size: int
    """Number of processes in the job."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    """Model replicas (``"auto"`` resolved)."""
    zero_stage: int
    sequence_parallel: bool
    expert_parallel_size: int
    context_parallel_size: int
    tensor_parallel: TensorParallelOptions
    pipeline: PipelineOptions
    """``num_microbatches`` filled in: the pipeline size unless given."""
    zero: ZeroOptions

    @classmethod
    def resolve(cls, *, world_size: int, **request: Any) -> ParallelLayout:
        """Validate the sizes against the world size and fill in ``data_parallel_size="auto"`` (``request``: the
        fields of :class:`LayoutRequest`)."""
        return LayoutRequest(**request).resolve(world_size)

    @property
    def data_dimension_size(self) -> int:
        """The size of the mesh's ``data`` dimension: replicas x context-parallel ranks (each replica's
        context-parallel ranks consecutive in it, tensor still fastest: Megatron's tp-cp-dp-pp order)."""
        return self.data_parallel_size * self.context_parallel_size

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline, data, tensor) coordinates of a global rank in the mesh; tensor varies fastest (Megatron's rank
        order). Under context parallel the data coordinate is replica x context_parallel_size + context rank."""
        tp, dp = self.tensor_parallel_size, self.data_dimension_size
        return rank // (tp * dp), (rank // tp) % dp, rank % tp

    def recorded_options(self) -> dict[str, Any]:
        """The pipeline settings recorded with the run, by their flat names (none without pipeline parallel)."""
        if self.pipeline_parallel_size == 1:
            return {}
        recorded = ("num_microbatches", "schedule", "virtual_pipeline_size", "partition")
        return {flat_argument("pipeline", name): getattr(self.pipeline, name) for name in recorded}

    def as_dict(self) -> dict[str, Any]:
        """The layout as plain types (for loggers, checkpoints and the start-up table)."""
        sizes = ("world_size", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "zero_stage")
        ep = {"expert_parallel_size": self.expert_parallel_size} if self.expert_parallel_size > 1 else {}
        if self.context_parallel_size > 1:
            ep["context_parallel_size"] = self.context_parallel_size
        return {**{k: getattr(self, k) for k in sizes}, "sequence_parallel": self.sequence_parallel, **ep,
                **self.recorded_options()}  # fmt: skip


def _check_expert_parallel(ep: int, dp: int, sequence_parallel: bool) -> None:
    """Expert parallel is carved out of the data-parallel ranks; what it does not compose with yet is refused."""
    if ep == 1:
        return
    if dp % ep != 0:
        raise HybridConfigError(
            f"`expert_parallel_size={ep}` must divide the data-parallel size ({dp}): the experts are split over"
            f" groups of {ep} data-parallel ranks. Choose a divisor of {dp}, or change the world size."
        )
    if sequence_parallel:
        # each tensor-parallel rank would route only its sequence shard: the router's and the experts' gradients
        # would need a sum over the tensor-parallel ranks that is not written (the first-step check catches it)
        raise HybridConfigError(
            f"`expert_parallel_size={ep}` does not run with `sequence_parallel=True` yet: each tensor-parallel rank"
            " would route only its part of the sequence. Set `sequence_parallel=False` (docs/expert-parallel.md)."
        )


def _check_context_parallel(request: LayoutRequest) -> None:
    """What context parallel does not compose with yet, refused at construction (every rank alike)."""
    cp = request.context_parallel_size
    if cp == 1:
        return
    # the unsplit copies of verify_pipeline and verify_tensor_parallel cannot run the context-parallel attention on
    # one rank; context parallel probes the step's loss itself, without a copy (context_parallel/verify.py)
    checks = {"verify_pipeline": request.pipeline.verify_pipeline,
              "verify_tensor_parallel": request.tensor_parallel.verify_tensor_parallel}  # fmt: skip
    for name, value in checks.items():
        if value is True:
            raise HybridConfigError(
                f"`context_parallel_size={cp}` does not run with `{name}=True`: its unsplit copy of the network is"
                " not made under context parallel, whose own first-step probe of the loss (always on, no copy)"
                " checks the step instead. Leave it 'auto' (off under context parallel) or False."
            )
    if request.expert_parallel_size > 1:
        # expert parallel's mesh splits the data dimension by replicas only
        raise HybridConfigError(
            f"`context_parallel_size={cp}` does not run with `expert_parallel_size={request.expert_parallel_size}`"
            " yet. Use `expert_parallel_size=1` with context parallel, or `context_parallel_size=1`"
            " (docs/context-parallel.md)."
        )


def check_compile(value: Any, request: LayoutRequest) -> None:
    """``compile`` is True or False, and not with a zero-bubble pipeline schedule (constructor time,
    collective-free, so every rank refuses alike).

    Example:
        >>> check_compile(True, LayoutRequest())
    """
    if not isinstance(value, bool):
        raise HybridConfigError(
            f"`compile` must be True or False, got {value!r}. True compiles each transformer block with"
            " torch.compile (docs/compile.md)."
        )
    schedule = request.pipeline.schedule
    if value and schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        # these schedules split each stage's backward into an input-gradient pass that keeps the graph and a later
        # weight-gradient pass; a compiled block's backward is one node that runs once and frees its buffers
        raise HybridConfigError(
            f"`compile=True` cannot run with `pipeline_schedule={schedule!r}`: the zero-bubble schedules run each"
            " block's backward in two passes (input gradients, then weight gradients), and a compiled block's"
            " backward runs as one. Use `pipeline_schedule='interleaved_1f1b'` (or '1f1b'/'gpipe') with compile,"
            " or `compile=False`."
        )


# what ``layout="auto"`` chooses: every size of the request (the planner keeps its ``sequence_parallel``, as it keeps
# the schedule: planning/auto.py, ``auto_request``), and the micro-batch count
_PLANNED_SIZES = tuple(
    f.name for f in fields(LayoutRequest) if f.name not in SECTIONS and f.name != "sequence_parallel"
)


def check_auto_layout(layout: Optional[str], request: LayoutRequest) -> None:
    """``layout`` is None or ``"auto"``; ``"auto"`` takes no explicit size (the planner chooses them all): no size of
    ``request`` and no micro-batch count away from its default.

    Example:
        >>> check_auto_layout("auto", LayoutRequest())
    """
    if layout is None:
        return
    if layout != "auto":
        raise HybridConfigError(f"`layout={layout!r}` must be 'auto' (let the planner choose) or None.")
    default = LayoutRequest()
    given = {k: getattr(request, k) for k in _PLANNED_SIZES if getattr(request, k) != getattr(default, k)}
    if request.pipeline.num_microbatches is not None:
        given["num_microbatches"] = request.pipeline.num_microbatches
    if given:
        raise HybridConfigError(
            "`layout='auto'` chooses the layout itself, but explicit sizes were given"
            f" ({', '.join(f'{k}={v!r}' for k, v in given.items())}). Drop them, or drop `layout='auto'` to use them."
            " To fix one dimension and plan the rest, run `lightning-hybrid plan` with e.g. `--tensor-parallel-size`"
            " and pass its answer."
        )
