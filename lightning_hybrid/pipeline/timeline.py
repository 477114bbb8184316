"""One pipeline step as a picture: gather every rank's timeline, export a Chrome trace, render a PNG, and the
schedule's theoretical bubble to compare with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist

from lightning_hybrid.pipeline.step_data import StepTimeline

__all__ = ["gather_timelines", "render_timeline", "theoretical_bubble", "to_chrome_trace"]

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


def theoretical_bubble(pipeline_parallel_size: int, num_microbatches: int, virtual_pipeline_size: int = 1) -> float:
    """Idle share of a step for GPipe/1F1B, (p-1)/(m+p-1) (Narayanan et al., 2021), with the interleaved schedule's
    bubble shrunk by the number of virtual stages per rank: (p-1)/(v*m+p-1).

    Example:
        >>> round(theoretical_bubble(4, 8), 3)
        0.273
    """
    p, m, v = pipeline_parallel_size, num_microbatches, virtual_pipeline_size
    return (p - 1) / (v * m + p - 1)


def gather_timelines(timeline: StepTimeline, group: Optional[Any] = None) -> list[StepTimeline]:
    """Every rank's timeline of the last step (a collective over ``group``, default: all ranks)."""
    if not dist.is_initialized():
        return [timeline]
    out: list[Optional[StepTimeline]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, timeline, group=group)
    return [t for t in out if t is not None]


def to_chrome_trace(timelines: list[StepTimeline], path: Optional[Union[str, Path]] = None) -> dict[str, Any]:
    """Chrome trace format (open in chrome://tracing or Perfetto): one row per rank, one slice per action."""
    events = []
    for t in timelines:
        events.append({"name": "process_name", "ph": "M", "pid": t.rank, "args": {"name": f"rank {t.rank}"}})
        for kind, stage, mb, start, end in t.events:
            slice_ = {"name": f"{kind}{mb}", "cat": kind, "ph": "X", "pid": t.rank, "tid": stage, "ts": start * 1e6}
            slice_.update(dur=(end - start) * 1e6, args={"stage": stage, "microbatch": mb})
            events.append(slice_)
        step = {"name": "step", "cat": "step", "ph": "X", "pid": t.rank, "tid": -1, "ts": 0, "dur": t.step_time * 1e6}
        events.append({**step, "args": {"bubble_fraction": t.bubble_fraction}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def render_timeline(timelines: list[StepTimeline], path: Union[str, Path], title: str = "") -> None:
    """A PNG of the step: one row per rank, forward blue, backward orange, weight-gradient green, idle blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(timelines) + 1.4))
    for row, t in enumerate(timelines):
        for kind, _, mb, start, end in t.events:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8), facecolors=_COLORS.get(kind, "grey"))
            ax.text((start + end) / 2 * 1e3, row, f"{kind}{mb}", ha="center", va="center", fontsize=7, color="white")
        ax.text(t.step_time * 1e3, row, f" bubble {t.bubble_fraction:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(timelines)), [f"rank {t.rank}" for t in timelines])
    ax.invert_yaxis()
    ax.set_xlabel("time in step (ms)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
