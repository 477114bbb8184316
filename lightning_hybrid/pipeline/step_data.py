"""One pipeline step as data: what the stage modules read while torch's schedule runs them, what the step gives
back to the strategy, and the timeline of its compute actions.

* :class:`StepContext` is built by the runner for one step and handed to every stage module for the schedule's run
  (``StageModule.context``); the split's receive/stop hooks read the stage being run from it (``active``).
* :class:`StepResults` is the step's loss or outputs and its logged values, the same on every rank; the strategy
  logs them once per step (:meth:`StepResults.log`).
* :class:`TimedStage` is torch's ``PipelineStage`` timing each forward/backward action into a :class:`StepTimeline`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor
from torch.distributed.pipelining import PipelineStage

from lightning_hybrid.transfers import PendingTransfers

__all__ = ["ActionTimer", "StepContext", "StepResults", "StepTimeline", "TimedStage"]

LogRecord = tuple[str, Any, tuple, dict]
"""One ``self.log(name, value, *args, **kwargs)`` call of the user's step."""


@dataclass
class StepContext:
    """One pipeline step on this rank, passed to the stage modules for the schedule's run.

    ``run_stage(context, stage, received)`` is what a stage module's forward calls (the runner's stage forward);
    ``active`` is the stage whose forward is running and the activation it received (None between actions).
    """

    mode: str
    microbatches: list[Any]
    extra: tuple
    steps: list[Any]
    """Each micro-batch's run of the user's step (``pipeline.paused.PausedStep``), paused at its first network call
    before the schedule; the last stage resumes it with the network's output."""
    run_stage: Callable[..., Any]
    calls: int = 1
    """How many times each micro-batch's step calls the network: each stage boundary carries one activation a call."""
    probe: Any = None
    """``verify_pipeline``'s check: the network call (``pipeline.paused.NetworkCall``) every micro-batch runs, the last
    stage returning a fixed projection of the output instead of resuming the user's step (None: the real step)."""
    counters: dict[int, int] = field(default_factory=dict)
    losses: list[Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    records: list[list[LogRecord]] = field(default_factory=list)
    """What the user's step logged, per micro-batch (last stage only)."""
    loss_scale: float = 1.0
    """Multiplies the loss the schedule differentiates: the fp16 loss scale over ``accumulate_grad_batches``."""
    weights: Optional[list[float]] = None
    """Each micro-batch's factor on its loss (default: loss scale / micro-batches; verify_pipeline keeps one)."""
    checks: Any = None
    """The structural checks, on the first training step only: the runner's ``pipeline.checks.FirstStepChecks``
    (not named in the type: the checks read the cut, whose stage modules read this context)."""
    active: Optional[tuple[int, Optional[Tensor]]] = None
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the step added to each torchmetrics object it updated (last stage only; ``MetricMirror.end``)."""
    state: Any = None
    """The tensors the step kept on the module (last stage only; ``pipeline.module_state.StateMirror.changes``)."""


@dataclass
class StepResults:
    """What one pipeline step gives Lightning, the same on every rank: ``output`` (the loss of a training step, the
    merged outputs of another step) and ``logged``, one record per name logged by the user's step: the mean over
    micro-batches by its ``reduce_fx`` (pipeline/logged.py).

    Example:
        >>> results = StepResults(output=None, logged=[("loss", 1.5, (), {"sync_dist": True})])
        >>> calls = []
        >>> _ = results.log(lambda *args, **kwargs: calls.append((args, kwargs)))
        >>> calls
        [(('loss', 1.5), {'sync_dist': True})]
    """

    output: Any
    logged: list[LogRecord] = field(default_factory=list)

    def log(self, log: Callable[..., None]) -> Any:
        """Call ``log`` (``LightningModule.log``; the strategy's step makes its ``sync_dist`` reduce over the
        data-parallel group, see :func:`lightning_hybrid.module_step.run_step`) once per logged name. Returns
        ``output``."""
        for name, value, args, kwargs in self.logged:
            log(name, value, *args, **kwargs)
        return self.output


@dataclass
class StepTimeline:
    """What this rank did during one pipeline step, from real timings (``time.perf_counter``).

    ``events`` are (kind, stage, micro-batch, start, end) in seconds from the step's start; kind is ``F`` (forward),
    ``B`` (full backward), ``I``/``W`` (input/weight halves of a zero-bubble backward). Everything else in the step is
    communication or waiting: the bubble.
    """

    rank: int = 0
    step_time: float = 0.0
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @property
    def compute_time(self) -> float:
        return sum(end - start for _, _, _, start, end in self.events)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step on this rank: 1 - compute / step time."""
        return max(0.0, 1.0 - self.compute_time / self.step_time) if self.step_time > 0 else 0.0


class ActionTimer:
    """The timeline of the current step, shared by this rank's :class:`TimedStage` objects."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.timeline = StepTimeline(rank=rank)
        self.start = 0.0
        self._left = 0
        self._before_last: Optional[Callable[[], None]] = None
        self.transfers = PendingTransfers()
        """The stages' point-to-point transfers in flight, told to the hang watchdog (``transfers.py``)."""

    def begin(self, before_last: Optional[tuple[int, Callable[[], None]]] = None) -> None:
        """Start a step's timeline; ``before_last`` = (actions in the step, callback): the callback runs as the
        step's last action starts (:meth:`starting`)."""
        self.timeline = StepTimeline(rank=self.rank)
        self._left, self._before_last = before_last if before_last is not None else (0, None)
        self.transfers.clear()
        self.start = time.perf_counter()

    def starting(self) -> None:
        """An action is about to start (``TimedStage`` calls it)."""
        if self._before_last is not None:
            self._left -= 1
            if self._left <= 0:
                callback, self._before_last = self._before_last, None
                callback()

    def end(self) -> None:
        self.timeline.step_time = time.perf_counter() - self.start
        self.transfers.clear()  # the schedule waited for every send before its step returned

    def record(self, kind: str, stage: int, chunk: int, begin: float) -> None:
        self.timeline.events.append((kind, stage, chunk, begin - self.start, time.perf_counter() - self.start))


class TimedStage(PipelineStage):
    """torch's ``PipelineStage``, recording each compute action the schedule runs on it (torch's schedules call
    these three methods once per micro-batch) into ``timer``'s timeline, and the send/receive ops the schedule asks
    it for into ``timer.transfers`` (the hang watchdog's view of the pipeline's transfers: the flight recorder has
    none under gloo). The method names are torch's stage internals, checked on torch 2.11 and 2.13 (see
    ``lightning_hybrid._torch_compat``)."""

    def __init__(self, *args: Any, timer: ActionTimer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timer = timer

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, args, kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        kind = "I" if kwargs.get("full_backward") is False else "B"
        return self._timed(kind, bwd_chunk_id, super().backward_one_chunk, args, kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, args, kwargs)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.timer.transfers.posted(("F", self.stage_index, fwd_chunk_id), ops)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.timer.transfers.posted(("B", self.stage_index, bwd_chunk_id), ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.timer.transfers.posted(None, ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.timer.transfers.posted(None, ops)
        return ops

    def _timed(self, kind: str, chunk: int, action: Callable, args: tuple, kwargs: dict) -> Any:
        # the gradient a backward reads came with the ops asked for as "B", for an input-only backward ("I") too
        self.timer.transfers.action_starts(("F" if kind == "F" else "B", self.stage_index, chunk))
        self.timer.starting()
        begin = time.perf_counter()
        try:
            return action(chunk, *args, **kwargs)
        finally:
            self.timer.record(kind, self.stage_index, chunk, begin)
