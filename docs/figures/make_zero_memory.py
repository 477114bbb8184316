"""Draw docs/figures/zero_memory.png: model-state bytes per rank for ZeRO stages 0-3.

A 1B-parameter model in fp32 trained with Adam on 4 data-parallel ranks, from the same formula the tests compare the
measured report with (``lightning_hybrid.sharding.expected_model_state_bytes``).

Usage (needs matplotlib, which the package itself does not):
    python3 docs/figures/make_zero_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_hybrid.sharding.memory import expected_model_state_bytes  # noqa: E402

NUM_PARAMETERS = 1_000_000_000
DATA_PARALLEL = 4
PARTS = [("parameters", "Parameters (fp32)", "#4C72B0"), ("gradients", "Gradients (fp32)", "#DD8452"),
         ("optimizer_state", "Optimizer state (Adam m, v; + fp32 master shard at stages 1-2)", "#55A868")]  # fmt: skip


def main(out: Path = HERE / "zero_memory.png") -> None:
    stages = [0, 1, 2, 3]
    per_stage = [
        expected_model_state_bytes(NUM_PARAMETERS, zero_stage=s, data_parallel_size=DATA_PARALLEL) for s in stages
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    labels = [f"ZeRO-{s}" for s in stages]
    bottom = [0.0] * len(stages)
    for key, label, color in PARTS:
        values = [b[key] / 1e9 for b in per_stage]
        ax.bar(labels, values, bottom=bottom, label=label, color=color, width=0.6)
        for i, v in enumerate(values):
            if v >= 0.8:
                ax.text(i, bottom[i] + v / 2, f"{v:g}", ha="center", va="center", color="white", fontsize=9)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, total in enumerate(bottom):
        ax.text(i, total + 0.25, f"{total:g} GB", ha="center", va="bottom", fontweight="bold")
    ax.set_ylabel("model-state bytes per rank (GB)")
    ax.set_ylim(0, max(bottom) * 1.35)
    ax.set_title(f"Model state per rank: 1B parameters, fp32 + Adam, data-parallel size {DATA_PARALLEL}")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, metadata={"Software": None})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
