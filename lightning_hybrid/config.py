"""The parallel layout as plain data, and its validation.

Everything here is pure Python on purpose: every rank evaluates the same checks on the same numbers and raises the
same error before any process group or collective exists, so a bad configuration can never hang a job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Union

from lightning_hybrid.pipeline_schedules import PIPELINE_SCHEDULES

__all__ = [
    "PIPELINE_PARTITIONS",
    "PIPELINE_SCHEDULES",
    "HybridConfigError",
    "ParallelLayout",
    "check_partition",
    "check_pipeline",
    "check_sizes",
]


class HybridConfigError(ValueError):
    """A configuration of :class:`~lightning_hybrid.HybridStrategy` that cannot work.

    The message names the parameter, the value given, and how to fix it.
    """


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridConfigError(f"`{name}` must be a positive integer, got {value!r}.")
    return value


def check_sizes(
    *,
    tensor_parallel_size: Any,
    pipeline_parallel_size: Any,
    data_parallel_size: Any,
    zero_stage: Any,
    sequence_parallel: bool = False,
) -> None:
    """The checks that need no world size (run in the strategy's constructor, on every rank alike)."""
    tp = _check_positive_int("tensor_parallel_size", tensor_parallel_size)
    _check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
    if data_parallel_size != "auto":
        _check_positive_int("data_parallel_size", data_parallel_size)
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


def check_pipeline(
    *,
    pipeline_parallel_size: int,
    num_microbatches: Any,
    pipeline_schedule: Any,
    virtual_pipeline_size: Any,
    pipeline_partition: Any = "uniform",
) -> None:
    """Pipeline options that need no model: schedule name, virtual stages, micro-batch count, partition."""
    check_partition(pipeline_partition)
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise HybridConfigError(f"`pipeline_schedule={pipeline_schedule!r}` is not one of {list(PIPELINE_SCHEDULES)}.")
    v = _check_positive_int("virtual_pipeline_size", virtual_pipeline_size)
    multi = pipeline_schedule in ("interleaved_1f1b", "interleaved_zero_bubble")
    if multi and v < 2:
        raise HybridConfigError(
            f"`pipeline_schedule={pipeline_schedule!r}` runs several stages per rank: set `virtual_pipeline_size`"
            " >= 2 (stages per rank), or use '1f1b'."
        )
    if pipeline_schedule == "zbv_zero_bubble" and v != 2:
        raise HybridConfigError(
            "`pipeline_schedule='zbv_zero_bubble'` places exactly 2 stages per rank (a V): set"
            " `virtual_pipeline_size=2`."
        )
    if pipeline_schedule in ("gpipe", "1f1b") and v != 1:
        raise HybridConfigError(
            f"`virtual_pipeline_size={v}` needs an interleaved schedule: set `pipeline_schedule='interleaved_1f1b'`"
            " (or 'interleaved_zero_bubble')."
        )
    if num_microbatches is not None:
        m = _check_positive_int("num_microbatches", num_microbatches)
        if pipeline_parallel_size > 1 and pipeline_schedule != "gpipe" and m < pipeline_parallel_size:
            raise HybridConfigError(
                f"`num_microbatches={m}` is smaller than `pipeline_parallel_size={pipeline_parallel_size}`: schedule"
                f" {pipeline_schedule!r} needs at least one micro-batch per stage in flight. Use num_microbatches >="
                f" {pipeline_parallel_size} (more micro-batches shrink the pipeline bubble)."
            )


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the world of processes is split: tensor x pipeline x data parallel, and the ZeRO stage over data.

    Example:
        >>> layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
        >>> layout.data_parallel_size
        2
    """

    world_size: int
    """Number of processes in the job."""
    tensor_parallel_size: int = 1
    """Ranks that split each layer's weights (innermost mesh dimension: consecutive ranks)."""
    pipeline_parallel_size: int = 1
    """Ranks that split the stack of layers into stages (outermost mesh dimension)."""
    data_parallel_size: int = 1
    """Model replicas that see different data; ZeRO shards over this dimension."""
    zero_stage: int = 1
    """0: replicate; 1: shard optimizer state; 2: also gradients; 3: also parameters."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence between tensor-parallel regions (Megatron-SP)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Free-form layout facts recorded with the run (schedule, micro-batches, precision, ...)."""

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        zero_stage: int = 1,
        sequence_parallel: bool = False,
        **extras: Any,
    ) -> ParallelLayout:
        """Validate the sizes against the world size and fill in ``data_parallel_size="auto"``."""
        _check_positive_int("world_size", world_size)
        check_sizes(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
        )
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        if world_size % (tp * pp) != 0:
            raise HybridConfigError(
                f"The world size ({world_size}) is not divisible by tensor_parallel_size x pipeline_parallel_size"
                f" ({tp} x {pp} = {tp * pp}). Change `tensor_parallel_size`/`pipeline_parallel_size`, or launch a"
                f" multiple of {tp * pp} processes (devices x num_nodes)."
            )
        if data_parallel_size == "auto":
            dp = world_size // (tp * pp)
        else:
            dp = data_parallel_size
            if tp * pp * dp != world_size:
                raise HybridConfigError(
                    f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {tp} x {pp} x {dp} ="
                    f" {tp * pp * dp}, but the world size is {world_size}. Set `data_parallel_size='auto'`"
                    f" (= {world_size // (tp * pp)}) or change the sizes so that their product is {world_size}."
                )
        return cls(
            world_size=world_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            extras=dict(extras),
        )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline, data, tensor) coordinates of a global rank; tensor varies fastest (Megatron's rank order)."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return rank // (tp * dp), (rank // tp) % dp, rank % tp

    def as_dict(self) -> dict[str, Any]:
        """The layout as plain types (for loggers, checkpoints and the start-up table)."""
        out = asdict(self)
        out.update(out.pop("extras"))
        return out
