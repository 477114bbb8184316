"""The monitor's one line per logging step, for the console."""

from __future__ import annotations

__all__ = ["format_console_line"]


def format_console_line(metrics: dict[str, float]) -> str:
    """One compact line: global step and batch, loss, LR, throughput, MFU, peak memory, communication, bubble, and
    the experts' load imbalance under expert parallel.

    Example:
        >>> format_console_line({"trainer/global_step": 10, "trainer/global_batch_index": 10, "train/loss": 2.5,
        ...     "train/lr": 1e-3, "throughput/tokens_per_s": 1234.0, "throughput/samples_per_s": 9.6,
        ...     "throughput/step_time_s": 0.5, "memory/peak_bytes_max": 2**30, "memory/peak_bytes_min": 2**29,
        ...     "comm/share": 0.2, "comm/share_tensor": 0.1, "comm/share_pipeline": 0.05, "comm/share_data": 0.05,
        ...     "pipeline/bubble_fraction": 0.25})
        'step 10 | batch 10 | loss 2.5000 | lr 1.00e-03 | 1.23k tok/s | 9.6 samples/s | step 0.500s | mem 1.00/0.50 GiB | comm 20% (tp 10% pp 5% dp 5%) | bubble 25%'
    """  # noqa: E501
    m = metrics
    parts = [
        f"step {int(m['trainer/global_step'])}",
        f"batch {int(m['trainer/global_batch_index'])}",
        f"loss {m['train/loss']:.4f}",
        f"lr {m['train/lr']:.2e}",
        f"{_si(m['throughput/tokens_per_s'])} tok/s",
        f"{m['throughput/samples_per_s']:.1f} samples/s",
        f"step {m['throughput/step_time_s']:.3f}s",
    ]
    if "throughput/mfu" in m:
        parts.append(f"mfu {m['throughput/mfu']:.1%}")
    parts.append(f"mem {m['memory/peak_bytes_max'] / 2**30:.2f}/{m['memory/peak_bytes_min'] / 2**30:.2f} GiB")
    dimensions = [("tp", "tensor"), ("pp", "pipeline"), ("dp", "data")]
    if m.get("comm/share_expert"):
        dimensions.append(("ep", "expert"))
    share = " ".join(f"{s} {m[f'comm/share_{d}']:.0%}" for s, d in dimensions)
    parts.append(f"comm {m['comm/share']:.0%} ({share})")
    parts.append(f"bubble {m['pipeline/bubble_fraction']:.0%}")
    if "experts/load_imbalance_max" in m:  # the most loaded expert over the mean, worst layer
        parts.append(f"experts max/mean {m['experts/load_imbalance_max']:.2f}")
    if m.get("train/skipped_steps"):
        parts.append(f"skipped {int(m['train/skipped_steps'])} scale {m.get('train/loss_scale', 1.0):.3g}")
    return " | ".join(parts)


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"
