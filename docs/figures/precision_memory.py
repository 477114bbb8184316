"""Draws precision_memory.png: model-state bytes per parameter by precision and ZeRO stage (the formula that
lightning_hybrid.sharding.memory.expected_model_state_bytes implements and the tests check against measurements).

Run: python docs/figures/precision_memory.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_hybrid.sharding.memory import expected_model_state_bytes  # noqa: E402

DP = 8
precisions = ["32-true", "bf16-mixed", "bf16-true"]
stages = [0, 1, 2, 3]
parts = ["parameters", "gradients", "optimizer_state"]
colors = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868"}

fig, ax = plt.subplots(figsize=(9, 4.4))
x, labels = 0, []
for precision in precisions:
    for stage in stages:
        got = expected_model_state_bytes(1, zero_stage=stage, data_parallel_size=DP, precision=precision)
        bottom = 0.0
        for part in parts:
            ax.bar(x, got[part], bottom=bottom, color=colors[part], label=part if x == 0 else None)
            bottom += got[part]
        ax.text(x, bottom + 0.2, f"{bottom:.1f}", ha="center", fontsize=8)
        labels.append(f"ZeRO-{stage}")
        x += 1
    ax.text(x - 2.5, -2.6, precision, ha="center", fontsize=9, weight="bold")
    x += 0.5
ticks = [i + 0.5 * (i // len(stages)) for i in range(len(labels))]
ax.set_xticks(ticks, labels, fontsize=8)
ax.set_ylabel(f"bytes per parameter per rank (Adam, dp={DP})")
ax.set_title("Model-state memory by precision and ZeRO stage (16-mixed = bf16-mixed; 16-true = bf16-true)")
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
fig.savefig(Path(__file__).with_name("precision_memory.png"), dpi=120)
