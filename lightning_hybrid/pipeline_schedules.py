"""The pipeline schedules ``HybridStrategy(pipeline_schedule=...)`` accepts, by the name of the class in
``torch.distributed.pipelining`` that runs each.

A leaf module (it imports nothing from the package), so the configuration checks (``config.py``) and the pipeline
runner read one table without importing each other.
"""

from __future__ import annotations

__all__ = ["MULTI_STAGE", "PIPELINE_SCHEDULES", "SCHEDULES", "SPLIT_BACKWARD"]

SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
"""Option value -> schedule class name in ``torch.distributed.pipelining``."""

MULTI_STAGE = frozenset({"interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"})
"""Schedules that run several stages per rank (built from a list of stages)."""

SPLIT_BACKWARD = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble"})
"""Schedules whose backward splits into input and weight halves: the input gradient comes from
``torch.autograd.grad``, laid out as the block made it (the others' full backward lays ``.grad`` out like the input)."""

PIPELINE_SCHEDULES = tuple(SCHEDULES)
