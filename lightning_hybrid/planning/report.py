"""The planner's answer (:class:`Plan`) and its three forms: a terminal table, JSON, and a PNG of stacked bars per
layout."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hybrid.planning.hardware import GB, Hardware
from lightning_hybrid.planning.model import ModelSpec
from lightning_hybrid.planning.search import Evaluated, Setup, _gb

__all__ = ["Plan", "format_table", "save_png", "to_json"]

LEDGER_KEYS = ("parameters", "gradients", "master", "optimizer", "activations", "buffers", "peak")


@dataclass
class Plan:
    """The planner's answer: ``layouts`` ranked best first, the decision rule's pick, and the inputs."""

    spec: ModelSpec
    hardware: Hardware
    setup: Setup
    layouts: list[Evaluated]
    rule: Optional[Evaluated]
    rule_reason: str

    @property
    def best(self) -> Optional[Evaluated]:
        """The first feasible layout of the ranking (None if none fits)."""
        return next((e for e in self.layouts if e.feasible), None)

    def table(self, limit: int = 12) -> str:
        return format_table(self, limit)

    def to_json(self) -> str:
        return to_json(self)

    def save_png(self, path: Union[str, Path], limit: int = 10) -> Path:
        return save_png(self, path, limit)


def layout_record(e: Any) -> dict[str, Any]:
    """One layout as plain types: its sizes (``expert_parallel_size`` included), verdict, step time and its terms
    (``compute``, ``bubble``, ``tensor``, ``data``, ``pipeline``, ``all_to_all``, ``total``), ledger.

    Example:
        >>> from lightning_hybrid.planning import plan
        >>> record = layout_record(plan(layers=2, hidden=64, heads=4, nodes=1, device_memory=1).layouts[0])
        >>> record["expert_parallel_size"], sorted(record["step_terms_s"])[:2]
        (1, ['all_to_all', 'bubble'])
    """
    c = e.candidate
    return {
        **c.sizes(),
        "num_microbatches": c.num_microbatches,
        "recompute": c.recompute,
        "feasible": e.feasible,
        "reason": e.reason,
        "step_time_s": e.step_time,
        "step_terms_s": e.step.as_dict() if e.step is not None else None,
        "ledger": e.ledger.as_dict(),
    }


def to_json(plan: Plan) -> str:
    """``{"layouts": [...]}`` best first (bytes on the most loaded device), and the decision rule's pick."""
    rule = plan.rule
    return json.dumps(
        {
            "layouts": [layout_record(e) for e in plan.layouts],
            "rule": {"reason": plan.rule_reason, "layout": layout_record(rule) if rule is not None else None},
        },
        indent=1,
    )


def format_table(plan: Plan, limit: int = 12) -> str:
    """The ranked layouts (at most ``limit`` feasible and ``limit`` infeasible), sizes in GB."""
    hw, spec = plan.hardware, plan.spec
    moe = a2a = ""
    if spec.is_moe:
        moe = (f" ({spec.experts} experts, top-{spec.top_k}, {len(spec.moe_layer_indices)} MoE layers:"
               f" {spec.expert_params / 1e9:.2f}B in experts, {spec.active_params / 1e9:.2f}B active)")  # fmt: skip
        a2a = f" {'a2a s':>7}"
    width = 40 if spec.is_moe else 34
    lines = [
        f"lightning-hybrid plan: {spec.total_params / 1e9:.2f}B parameters{moe}, {spec.layers} layers, hidden"
        f" {spec.hidden}, seq {spec.seq}, micro-batch {plan.setup.micro_batch}, {plan.setup.precision},"
        f" {plan.setup.optimizer}; {hw.nodes} x {hw.devices_per_node} x {_gb(hw.device_memory)}",
        f"{'#':>3} {'layout':<{width}} {'params':>7} {'grads':>7} {'master':>7} {'optim':>7} {'activ':>7}"
        f" {'buffers':>7} {'peak':>7} {'step s':>8}{a2a}  verdict",
    ]
    feasible = [e for e in plan.layouts if e.feasible][:limit]
    infeasible = [e for e in plan.layouts if not e.feasible][:limit]
    if plan.rule is not None and plan.rule not in feasible:
        feasible.append(plan.rule)  # the decision rule's pick is always shown, ranked where it is
    top = max((e.ledger.peak for e in feasible + infeasible), default=GB)
    unit, size = next((u, s) for u, s in (("GB", GB), ("MB", 1e6), ("KB", 1e3), ("B", 1)) if top >= 10 * s or s == 1)
    lines[1] = (
        lines[1]
        .replace("layout", f"layout ({unit})", 1)
        .replace(f"layout ({unit})" + " " * len(f" ({unit})"), f"layout ({unit})")
    )
    for e in feasible + infeasible:
        i = plan.layouts.index(e)
        ledger = e.ledger
        cells = " ".join(f"{getattr(ledger, k) / size:>7.1f}" for k in LEDGER_KEYS[:-1])
        step = f"{e.step_time:>8.3f}" if e.step_time is not None else f"{'-':>8}"
        if spec.is_moe:  # expert parallel's all-to-all, its own term of the step time
            step += f" {e.step.all_to_all:>7.3f}" if e.step is not None else f" {'-':>7}"
        mark = " <- rule" if plan.rule is e else ""
        verdict = "ok" if e.feasible else "NO: " + e.reason
        row = f"{i + 1:>3} {e.candidate.describe():<{width}} {cells} {ledger.peak / size:>7.1f} {step}"
        lines.append(f"{row}  {verdict}{mark}")
    lines.append(plan.rule_reason + (f": {plan.rule.candidate.describe()}" if plan.rule is not None else ""))
    best = plan.best
    if best is not None and plan.rule is not None and best is not plan.rule and plan.rule.step is not None:
        faster = plan.rule.seconds_per_token / best.seconds_per_token - 1
        lines.append(f"ranked first: {best.candidate.describe()}, an estimated {faster:.0%} more tokens/s than the"
                     " rule's pick")  # fmt: skip
    return "\n".join(lines)


def save_png(plan: Plan, path: Union[str, Path], limit: int = 10) -> Path:
    """Stacked bars of the ledger per layout (the best ``limit``), with the usable device memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plan.layouts[:limit]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 4.5))
    bottoms = [0.0] * len(shown)
    for key in LEDGER_KEYS[:-1]:
        values = [getattr(e.ledger, key) / GB for e in shown]
        ax.bar(range(len(shown)), values, bottom=bottoms, label=key)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    hw = plan.hardware
    ax.axhline(hw.usable_memory / GB, color="black", linestyle="--", linewidth=1,
               label=f"{hw.device_memory / GB:.0f} GB x {hw.usable_fraction:g}")  # fmt: skip
    labels = [e.candidate.describe().replace(" zero", "\nzero") + ("" if e.feasible else "\n(no)") for e in shown]
    ax.set_xticks(range(len(shown)), labels, fontsize=7)
    ax.set_ylabel("GB per device (most loaded)")
    ax.set_title(f"{plan.spec.total_params / 1e9:.1f}B on {hw.nodes} x {hw.devices_per_node} x"
                 f" {hw.device_memory / GB:.0f} GB, best first")  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
