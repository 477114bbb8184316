"""The parallel layout as plain data, and its validation.

Everything here is pure Python on purpose: every rank evaluates the same checks on the same numbers and raises the
same error before any process group or collective exists, so a bad configuration can never hang a job.

``HybridStrategy`` takes each option in one of two forms: flat (``pipeline_schedule="gpipe"``, as LightningCLI/YAML
give them) or in its typed section (``pipeline=PipelineOptions(schedule="gpipe")``, see :data:`SECTIONS`). One name
per option, by one rule (:func:`flat_argument`): a field of one word takes its section's name in front in the flat form
(``plan`` <-> ``tensor_parallel_plan``, ``verify`` <-> ``checkpoint_verify``), since alone it would not say what it
belongs to; a field of several words is already specific and is the flat name as it is (``num_microbatches``,
``bucket_cap_mb``, ``verify_pipeline``). The sizes (``tensor_parallel_size``, ``pipeline_parallel_size``,
``data_parallel_size``, ``zero_stage``) and ``sequence_parallel`` are the layout's own fields and are given flat.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

from lightning_hybrid.pipeline_schedules import PIPELINE_SCHEDULES

__all__ = [
    "PIPELINE_PARTITIONS",
    "PIPELINE_SCHEDULES",
    "SECTIONS",
    "CheckpointOptions",
    "HybridConfigError",
    "PipelineOptions",
    "TensorParallelOptions",
    "ZeroOptions",
    "checkpoint_mode",
    "check_partition",
    "build_section",
    "check_positive_int",
    "check_pretrained_weights",
    "check_sizes",
    "flat_argument",
    "takes_fields_of",
]


class HybridConfigError(ValueError):
    """A configuration of :class:`~lightning_hybrid.HybridStrategy` that cannot work.

    The message names the parameter, the value given, and how to fix it.
    """


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridConfigError(f"`{name}` must be a positive integer, got {value!r}.")
    return value


def checkpoint_mode(value: Union[bool, str, None]) -> Optional[str]:
    """``None``, ``"full"`` or ``"selective"`` for the value of ``activation_checkpointing`` (``True`` is ``"full"``).

    Example:
        >>> checkpoint_mode(True), checkpoint_mode("selective"), checkpoint_mode(False)
        ('full', 'selective', None)
    """
    if value is None or value is False or value == "none":
        return None
    if value is True or value == "full":
        return "full"
    if value == "selective":
        return "selective"
    raise HybridConfigError(
        f"`activation_checkpointing={value!r}` must be False, True / 'full' (recompute each block) or 'selective'"
        " (keep matmul and attention outputs, recompute the pointwise ops)."
    )


def check_sizes(
    *,
    tensor_parallel_size: Any,
    pipeline_parallel_size: Any,
    data_parallel_size: Any,
    zero_stage: Any,
    sequence_parallel: bool = False,
    expert_parallel_size: Any = 1,
    context_parallel_size: Any = 1,
) -> None:
    """The checks that need no world size (run in the strategy's constructor, on every rank alike)."""
    tp = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    check_positive_int("expert_parallel_size", expert_parallel_size)
    cp = check_positive_int("context_parallel_size", context_parallel_size)
    check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
    if data_parallel_size != "auto":
        check_positive_int("data_parallel_size", data_parallel_size)
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2, 3):
        raise HybridConfigError(
            f"`zero_stage` must be 0, 1, 2 or 3, got {zero_stage!r}. 0 replicates the model, 1 shards optimizer"
            " state, 2 also gradients, 3 also parameters over the data-parallel ranks."
        )
    if sequence_parallel and tp == 1:
        raise HybridConfigError(
            "`sequence_parallel=True` needs `tensor_parallel_size` > 1: sequence parallelism splits the"
            " activations between tensor-parallel regions across the tensor-parallel ranks."
        )
    if cp > 1 and sequence_parallel:
        raise HybridConfigError(
            f"`context_parallel_size={cp}` does not run with `sequence_parallel=True` yet: both split the sequence."
            " Set `sequence_parallel=False` (docs/context-parallel.md)."
        )


PIPELINE_PARTITIONS = ("uniform", "parameters", "profile")


def check_partition(partition: Any) -> None:
    """``pipeline_partition`` is one of :data:`PIPELINE_PARTITIONS` or a list of positive block counts, one per stage.
    How many counts and their sum depend on the model, and are checked when it is cut.

    Example:
        >>> check_partition([3, 5])
        >>> try:
        ...     check_partition("even")
        ... except HybridConfigError as error:
        ...     print(str(error)[:56])
        `pipeline_partition='even'` is not a partition name: use
    """
    fix = (
        f"use one of {list(PIPELINE_PARTITIONS)}, or a list of positive block counts, one per stage"
        " (pipeline_parallel_size x virtual_pipeline_size of them, summing to the number of blocks), e.g. [3, 5]"
    )
    if isinstance(partition, str):
        if partition not in PIPELINE_PARTITIONS:
            raise HybridConfigError(f"`pipeline_partition={partition!r}` is not a partition name: {fix}.")
        return
    counts = list(partition) if isinstance(partition, (list, tuple)) else None
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
        raise HybridConfigError(
            f"`pipeline_partition={partition!r}` is neither a partition name nor a list of block counts: {fix}."
        )


AUTO_MAX_PARAMETERS = 100_000_000
"""``verify_pipeline="auto"`` is on when the whole model has at most this many parameters (one rank then holds a
full fp32 copy, 0.4 GB, and its gradients, for the first step)."""


def check_verify_pipeline(value: Any, name: str = "verify_pipeline") -> None:
    """Refuse anything but ``True``, ``False`` or ``"auto"`` for ``name`` (``verify_pipeline``,
    ``verify_tensor_parallel``; constructor time, collective-free).

    Example:
        >>> check_verify_pipeline("auto")
    """
    if not (value is True or value is False or value == "auto"):
        raise HybridConfigError(
            f"`{name}` must be True, False or 'auto', got {value!r}. 'auto' compares the first batch with an"
            f" unsplit forward when the model has at most {AUTO_MAX_PARAMETERS:,} parameters and trains in fp32."
        )


@dataclass(frozen=True, kw_only=True)
class TensorParallelOptions:
    """How layers are split over the tensor-parallel ranks (``HybridStrategy``'s ``tensor_parallel=`` section; the
    size is the layout's ``tensor_parallel_size``).

    Example:
        >>> TensorParallelOptions(plan={"*.mlp.up": "colwise", "*.mlp.down": "rowwise"}).vocab_parallel_loss
        True
    """

    plan: Union[str, dict[str, Any]] = "auto"
    """``"auto"`` (find the plan; Hugging Face models use the plan they declare) or a dict ``{module-name pattern:
    "colwise" | "rowwise" | ParallelStyle}`` (docs/tensor-parallel.md). If ``configure_model`` already parallelized the
    model with ``self.device_mesh["tensor"]``, the plan is not applied."""
    vocab_parallel_loss: bool = True
    """Keep the logits split over the vocabulary: a cross-entropy never gathers them, any other use of them gathers
    them once (exact either way: docs/tensor-parallel.md)."""
    verify_tensor_parallel: Union[bool, Literal["auto"]] = "auto"
    """Without pipeline parallel (``verify_pipeline`` covers both together): on the first batch, compare the split
    model's loss and gradient norm with an unsplit copy on one rank, and refuse the run on a mismatch; under context
    parallel, the user's step's loss (and its gradient at the network's outputs) on each rank's part against the whole
    batch (docs/context-parallel.md). ``"auto"``: on for fp32 models of at most 100M parameters."""

    def __post_init__(self) -> None:
        check_verify_pipeline(self.verify_tensor_parallel, "verify_tensor_parallel")
        if not (self.plan == "auto" or isinstance(self.plan, dict)):
            raise HybridConfigError(
                f"`tensor_parallel_plan` must be 'auto' or a dict {{module-name pattern: style}}, got {self.plan!r}."
            )


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """How the block list is cut into stages and scheduled (``HybridStrategy``'s ``pipeline=`` section; the size is
    the layout's ``pipeline_parallel_size``).

    Example:
        >>> PipelineOptions(schedule="interleaved_1f1b", virtual_pipeline_size=2, num_microbatches=8).partition
        'uniform'
    """

    num_microbatches: Optional[int] = None
    """Micro-batches per optimizer step under pipeline parallel (``None``: the pipeline size, filled in by
    :meth:`LayoutRequest.resolve`); must divide the DataLoader's batch size."""
    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"`` or ``"zbv_zero_bubble"``
    (:data:`PIPELINE_SCHEDULES`: torch's ``pipelining`` schedules)."""
    virtual_pipeline_size: int = 1
    """Stages per rank: >= 2 for the interleaved schedules, 2 for ``"zbv_zero_bubble"``, 1 for the others."""
    partition: Union[str, list[int]] = "uniform"
    """Blocks per stage: ``"uniform"``, ``"parameters"``, ``"profile"`` (measured time on rank 0; these are
    :data:`PIPELINE_PARTITIONS`), or a list of block counts, one per stage."""
    network: Optional[str] = None
    """Name of the module ``training_step`` calls (whose ``forward`` the stages run), if not the one that owns the
    block list."""
    verify_pipeline: Union[bool, Literal["auto"]] = "auto"
    """On the first batch, compare the pipelined loss and gradient norm of one micro-batch with an unsplit forward of
    a copy of the network on one rank, and refuse the run on a mismatch. ``"auto"``: on for fp32 models of at most
    100M parameters; ``True``: always; ``False``: off (the structural checks of the first step still run)."""

    def __post_init__(self) -> None:
        check_partition(self.partition)
        schedule, v = self.schedule, self.virtual_pipeline_size
        if schedule not in PIPELINE_SCHEDULES:
            raise HybridConfigError(f"`pipeline_schedule={schedule!r}` is not one of {list(PIPELINE_SCHEDULES)}.")
        check_positive_int("virtual_pipeline_size", v)
        if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and v < 2:
            raise HybridConfigError(
                f"`pipeline_schedule={schedule!r}` runs several stages per rank: set `virtual_pipeline_size`"
                " >= 2 (stages per rank), or use '1f1b'."
            )
        if schedule == "zbv_zero_bubble" and v != 2:
            raise HybridConfigError(
                "`pipeline_schedule='zbv_zero_bubble'` places exactly 2 stages per rank (a V): set"
                " `virtual_pipeline_size=2`."
            )
        if schedule in ("gpipe", "1f1b") and v != 1:
            raise HybridConfigError(
                f"`virtual_pipeline_size={v}` needs an interleaved schedule: set `pipeline_schedule='interleaved_1f1b'`"
                " (or 'interleaved_zero_bubble')."
            )
        if self.num_microbatches is not None:
            check_positive_int("num_microbatches", self.num_microbatches)
        check_verify_pipeline(self.verify_pipeline)

    def check_stages(self, pipeline_parallel_size: int) -> None:
        """The micro-batch count against the number of pipeline ranks."""
        m, pp = self.num_microbatches, pipeline_parallel_size
        if m is not None and pp > 1 and self.schedule != "gpipe" and m < pp:
            raise HybridConfigError(
                f"`num_microbatches={m}` is smaller than `pipeline_parallel_size={pp}`: schedule"
                f" {self.schedule!r} needs at least one micro-batch per stage in flight. Use num_microbatches >="
                f" {pp} (more micro-batches shrink the pipeline bubble)."
            )


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """How gradients and optimizer state are reduced and sharded over the data-parallel ranks (``HybridStrategy``'s
    ``zero=`` section; the stage is the layout's ``zero_stage``).

    Example:
        >>> ZeroOptions(bucket_cap_mb=50).bucket_cap_mb
        50.0
    """

    zero3_gradient_sync: Literal["per_step", "per_microbatch"] = "per_step"
    """ZeRO-3 under pipeline parallel: ``"per_step"`` keeps each stage's gradients unsharded across micro-batches and
    reduce-scatters once per step (more memory, less communication); ``"per_microbatch"`` reduce-scatters and frees
    them after every micro-batch's backward."""
    overlap_grad_reduce: bool = True
    """At ``zero_stage=0`` without pipeline parallel (and without a ``-true`` precision's master weights), average the
    gradients over the data-parallel replicas in buckets during the step's last backward pass, overlapping
    communication with backward as DDP does; at ``zero_stage=2`` without pipeline parallel, reduce each bucket to the
    ranks that own its shard during every backward pass, so no rank holds the full gradient; ``False``: one reduction
    of all gradients after backward."""
    bucket_cap_mb: float = 25.0
    """Size of those buckets in MiB (DDP's ``bucket_cap_mb``; the first bucket is at most 1 MiB)."""
    offload_optimizer: bool = False
    """Keep this rank's fp32 master weights and Adam moments in host memory and step them with DeepSpeed's
    ``DeepSpeedCPUAdam`` (ZeRO-Offload; needs ``pip install "lightning-hybrid[deepspeed]"`` and a torch Adam/AdamW
    optimizer). The device keeps parameters and gradients only."""

    def __post_init__(self) -> None:
        if self.zero3_gradient_sync not in ("per_step", "per_microbatch"):
            raise HybridConfigError(
                f"`zero3_gradient_sync` must be 'per_step' or 'per_microbatch', got {self.zero3_gradient_sync!r}."
            )
        size = self.bucket_cap_mb
        if not (isinstance(size, (int, float)) and size > 0):
            raise HybridConfigError(f"`bucket_cap_mb` must be a positive number of MiB, got {size!r}.")
        object.__setattr__(self, "bucket_cap_mb", float(size))
        object.__setattr__(self, "offload_optimizer", bool(self.offload_optimizer))


def check_pretrained_weights(source: Any) -> str:
    """``source`` as a path string if it looks like a safetensors source (on this rank's file system: every rank
    checks its own, since each reads its slices from it); :class:`HybridConfigError` otherwise.

    Example:
        >>> # check_pretrained_weights("Llama-3.2-1B")  # 'Llama-3.2-1B', a folder written by save_pretrained
    """
    import importlib.util
    import os

    if importlib.util.find_spec("safetensors") is None:
        raise HybridConfigError(
            f"`pretrained_weights={source!r}` reads safetensors files, and safetensors is not installed:"
            " `pip install 'lightning-hybrid[hf]'` (or `pip install safetensors`)."
        )
    if not isinstance(source, (str, os.PathLike)):
        raise HybridConfigError(f"`pretrained_weights` must be a path (str), got {type(source).__name__} {source!r}.")
    path = os.fspath(source)
    fix = (
        "Give a folder holding model.safetensors or model.safetensors.index.json (what `save_pretrained` and"
        " `lightning-hybrid consolidate` write) or a .safetensors file, on every node's file system."
    )
    if not os.path.exists(path):
        raise HybridConfigError(f"`pretrained_weights={path!r}` does not exist on this machine. {fix}")
    names = ("model.safetensors", "model.safetensors.index.json")
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return path
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n)) for n in names):
        return path
    resume = " (a lightning-hybrid checkpoint resumes with `trainer.fit(ckpt_path=...)`)"
    raise HybridConfigError(f"`pretrained_weights={path!r}` holds no safetensors weights{resume}. {fix}")


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How checkpoints are written and checked, and the weights training starts from (``HybridStrategy``'s
    ``checkpoint=`` section).

    Example:
        >>> CheckpointOptions(async_checkpoint=True).verify
        True
    """

    async_checkpoint: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``): a save copies this rank's
    shards to CPU memory and training goes on while they are written; the next save and the end of training wait for
    it. The checkpoint appears under its name only once complete, as with synchronous saves."""
    verify: bool = True
    """``checkpoint_verify``: on load, check every file of the checkpoint against the size and SHA-256 its commit
    record holds (each rank hashes its share of the files: about 1-2 s of one core per GB), and let
    ``ckpt_path="last"`` skip a checkpoint that fails for the newest one in its directory that passes. ``False`` loads
    without hashing (sizes are still checked), also checkpoints without a commit record. Saves always write the
    record."""
    pretrained_weights: Optional[str] = None
    """Start training from these weights (a Hugging Face folder with ``model.safetensors`` or
    ``model.safetensors.index.json``, ``lightning-hybrid consolidate`` output, or a ``.safetensors`` file): loaded after
    the model is split, each rank reading only its own slices (``checkpoint/pretrained.py``). A resume with
    ``trainer.fit(ckpt_path=...)`` overwrites them (docs/checkpoint.md)."""

    def __post_init__(self) -> None:
        if self.pretrained_weights is not None:
            object.__setattr__(self, "pretrained_weights", check_pretrained_weights(self.pretrained_weights))


SECTIONS: dict[str, type] = {
    "tensor_parallel": TensorParallelOptions,
    "pipeline": PipelineOptions,
    "zero": ZeroOptions,
    "checkpoint": CheckpointOptions,
}
"""``HybridStrategy``'s typed sections, by the keyword that takes each."""


def flat_argument(section: str, name: str) -> str:
    """The flat ``HybridStrategy`` argument of the field ``name`` of ``section`` (a key of :data:`SECTIONS`): a field
    of one word takes the section's name in front, one of several words is the flat name as it is.

    Example:
        >>> flat_argument("pipeline", "schedule"), flat_argument("pipeline", "num_microbatches")
        ('pipeline_schedule', 'num_microbatches')
    """
    return name if "_" in name else f"{section}_{name}"


def build_section(section: str, flat: Mapping[str, Any], given: Any) -> Any:
    """The section ``section`` (a key of :data:`SECTIONS`) from the flat arguments (``flat``, by name; one not there
    is at its default) and the section object ``given`` (or None), validated once, by the section's own checks. An
    option counts as given where its value differs from its default: given in the section, the section's value is
    used; given both ways with different values, it is a :class:`HybridConfigError` naming both.

    Example:
        >>> zero = build_section("zero", {"bucket_cap_mb": 50}, ZeroOptions(offload_optimizer=True))
        >>> zero.bucket_cap_mb, zero.offload_optimizer
        (50.0, True)
    """
    options = SECTIONS[section]
    if given is not None and not isinstance(given, options):
        raise HybridConfigError(
            f"`{section}` must be a lightning_hybrid.{options.__name__}(...) or None, got {type(given).__name__}"
            f" {given!r}. Give its options as `{section}={options.__name__}(...)` or as flat arguments."
        )
    values = {}
    for option in fields(options):
        name = flat_argument(section, option.name)
        value = flat.get(name, option.default)
        if given is not None and getattr(given, option.name) != option.default:
            in_section = getattr(given, option.name)
            if value != option.default and value != in_section:
                raise HybridConfigError(
                    f"`{name}={value!r}` and `{section}={options.__name__}({option.name}={in_section!r})` give the same"
                    f" option two different values. Give it once: as the flat argument `{name}` or in the section."
                )
            value = in_section
        values[option.name] = value
    return options(**values)


def takes_fields_of(
    options: type, *, keyword_only: bool = True
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give ``__init__(self, ..., **settings)`` the fields of the dataclass ``options`` as parameters after its own
    (keyword-only unless ``keyword_only=False``), their names, types and defaults read from the fields: so each default
    is written once, in its field, and ``inspect.signature``, ``typing.get_type_hints`` and LightningCLI's jsonargparse
    read the constructor as if written by hand (``--help``, type checks, YAML ``init_args``). The init receives the
    arguments given, by name (``options(**settings)`` fills in the rest); an argument that is none of them, or given
    twice, is a ``TypeError`` as for a hand-written signature.

    Example:
        >>> @dataclass(frozen=True)
        ... class Sizes:
        ...     width: int = 2
        >>> class Box:
        ...     @takes_fields_of(Sizes)
        ...     def __init__(self, name: str = "box", **sizes: Any) -> None:
        ...         self.sizes = Sizes(**sizes)
        >>> inspect.signature(Box)
        <Signature (name: str = 'box', *, width: int = 2) -> None>
        >>> Box(width=3).sizes.width
        3
    """
    kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
    hints = typing.get_type_hints(options)
    added = [inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]) for f in fields(options)]

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        own_hints = typing.get_type_hints(init)
        own = [p.replace(annotation=own_hints.get(p.name, p.annotation))
               for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]  # fmt: skip
        signature = inspect.Signature([*own, *added], return_annotation=None)

        def init_with_fields(*args: Any, **kwargs: Any) -> None:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError as error:  # as Python words it for a hand-written signature
                raise TypeError(f"{init.__qualname__}() {error}") from None
            init(**arguments)

        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(init_with_fields, name, getattr(init, name))
        init_with_fields.__signature__ = signature  # type: ignore[attr-defined]
        init_with_fields.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                                            if p.annotation is not p.empty} | {"return": None}  # fmt: skip
        return init_with_fields

    return decorate
