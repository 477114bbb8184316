"""The user's step before the schedule: every micro-batch's step run to its network call, and what its calls are.

Each rank of a pipeline runs each micro-batch's step once (pipeline/paused.py), in micro-batch order, up to its first
call of the network: the code before the call (random draws, counters, prints) runs as on one device, and the call's
arguments are known on every rank. The ranks that do not hold the last stage then resume each step with stand-ins for
the output (pipeline/stand_in.py) up to its last call, to learn the arguments of the step's other calls (a second
view, the rejected half of a preference pair), whose first stages they compute; the last stage resumes each step with
the real output when the schedule reaches it, and the other ranks run the code after each step's last call on
stand-ins once the schedule is done: every rank runs every micro-batch's step once, to its end.

How many calls a step makes, and what shape and dtype each call's activation has at each stage boundary, must be the
same on every rank before the schedule is built (torch's stages allocate their receive buffers by them), but only the
ranks that run the steps past their calls can see it. So, once per shape of the network's inputs (when the schedule
is built for it), one of them (the *source*: the lowest pipeline rank without the last stage) runs every step to its
end with stand-ins, and tells the others (:class:`CallPlan`, one object broadcast); afterwards the steps are run to
their last call only, and the code after it runs on the last stage alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_hybrid.pipeline.paused import NetworkCall, PausedStep
from lightning_hybrid.pipeline.random_streams import RandomStreams
from lightning_hybrid.pipeline.stand_in import StandInRead, contains_stand_in

__all__ = ["CallPlan", "agree_on_plan", "run_past_calls"]

Boundary = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class CallPlan:
    """What each micro-batch's step does with the network, the same on every rank of a pipeline.

    Example:
        >>> plan = CallPlan(calls=2, entering=((((), torch.float32), ((4, 8), torch.float32)),) * 2)
        >>> plan.calls, plan.refusal is None
        (2, True)
    """

    calls: int
    entering: tuple[tuple[Boundary, ...], ...] = ()
    """Per call, per stage: the shape and dtype of the activation entering the stage (stage 0's: unused)."""
    traces: tuple[Any, ...] = ()
    """Per call, the unsplit network's forward on its inputs (``pipeline.boundaries.UnsplitForward``, None where it
    could not run on meta tensors): the parameters one device differentiates, what each block returns."""
    refusal: Optional[str] = None
    """Why the step cannot be pipelined as it is, said alike on every rank."""
    stopped: Optional[str] = None
    """Where the source's run of the steps past their calls stopped early (a value read of the output): later calls,
    if any, were not seen."""


def run_past_calls(
    steps: list[PausedStep],
    stand_in: Callable[[NetworkCall], Any],
    streams: RandomStreams,
    until: Optional[int],
) -> tuple[list[int], Optional[str], Optional[str]]:
    """Resume each paused step (in micro-batch order, each in its own random stream) with ``stand_in(call)`` for its
    calls' outputs, up to its ``until``-th call, where it stays paused (None: to its end). Returns the calls each step
    made, where a step stopped early (a value read of a stand-in), and a refusal (a call whose arguments are
    computed from an earlier call's output).

    Example:
        >>> # counts, stopped, refusal = run_past_calls(steps, stand_in_of, streams, until=plan.calls)
    """
    counts: list[int] = []
    stopped: Optional[str] = None
    refusal: Optional[str] = None
    for i, step in enumerate(steps):
        streams.use(("after", i))
        while step.pending is not None:
            if until is not None and len(step.calls) >= until:
                break
            output = stand_in(step.pending)
            if output is None:
                stopped = stopped or "the network's output could not be computed on meta tensors to stand in for it"
                step.end()  # the code after the call cannot run here: the step ends at the call
                break
            try:
                step.resume(output)
            except StandInRead as read:
                stopped = stopped or f"{read}"
                break
            except Exception as error:  # user code the stand-ins cannot run: the last stage runs it on real values
                stopped = stopped or f"{type(error).__name__}: {error}"
                break
        later = step.calls[1:]
        if refusal is None and any(contains_stand_in((c.args, c.kwargs)) for c in later):
            refusal = (
                "its step calls the network again with arguments computed from the output of an earlier call: under"
                " pipeline parallel every call's inputs must be known before the first stage runs (the output exists"
                " only on the last stage, once the schedule has run). Compute both calls' inputs before the first"
                " call, or train without pipeline parallel (`pipeline_parallel_size=1`)"
            )
        counts.append(len(step.calls))
    streams.use("before")
    return counts, stopped, refusal


def agree_on_plan(found: Optional[CallPlan], source: int, group: Any) -> CallPlan:
    """The source rank's :class:`CallPlan`, on every rank of the pipeline ``group`` (one object broadcast)."""
    payload: list[Optional[CallPlan]] = [found]
    dist.broadcast_object_list(payload, src=source, group=group)
    plan = payload[0]
    assert plan is not None
    return plan
