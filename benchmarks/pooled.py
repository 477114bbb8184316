"""Pool several runs of the side-by-side comparisons into one ratio per row.

One run of a row whose target sits a few percent above parity cannot decide it on a shared machine: the rounds of one
run share its minutes of the machine's speed, and on the 2-core test machine single runs of ``host_overhead_over_floor``
moved between 0.94x and 1.18x for one tree. Pooling the paired rounds of many runs (each round: HybridStrategy, then
the reference, in the same process) and bootstrapping their median gives a figure and an interval that can.

Usage, comparing two trees (run ``python -m benchmarks.run_all --only ROW --out-dir DIR`` alternately on each):
    python -m benchmarks.pooled --label before runs/before_* --label now runs/now_*

Example:
    >>> rounds = [{"a": {"wall": [1.1, 1.0], "cpu": [1.0, 1.0]}, "b": {"wall": [1.0, 1.0], "cpu": [1.0, 1.0]}}]
    >>> pooled = pool_rows([{"records": {"row": {"rounds": rounds}}, "summaries": {"row": {"ratio": 1.05}}}])
    >>> round(pooled["row"].median, 3), pooled["row"].runs
    (1.05, [1.05])
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOOTSTRAP_SAMPLES = 2000


@dataclass
class PooledRow:
    """One row over several runs: the median of all paired rounds' wall-time ratios (A over B) with a bootstrap 95%
    interval, the same median for CPU time, and each run's own ratio."""

    median: float
    low: float
    high: float
    cpu_median: float
    rounds: int
    runs: list[float]


def round_ratios(rounds: list[dict[str, Any]], clock: str = "wall") -> list[float]:
    """Each round's ratio of medians (A's steps over B's), as ``benchmarks.compare`` computes a run's ratio."""
    return [statistics.median(r["a"][clock]) / statistics.median(r["b"][clock]) for r in rounds]


def bootstrap_median(values: list[float], seed: int = 0) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of the median of ``values`` resampled with replacement (seeded: reproducible)."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES))
    return medians[int(0.025 * BOOTSTRAP_SAMPLES)], medians[int(0.975 * BOOTSTRAP_SAMPLES) - 1]


def pool_rows(results: list[dict[str, Any]]) -> dict[str, PooledRow]:
    """Every row found in ``results`` (the ``side_by_side.json`` of several runs), pooled over the runs having it."""
    names = sorted({name for result in results for name in result.get("records", {})})
    pooled = {}
    for name in names:
        runs = [r for r in results if name in r.get("records", {}) and r["records"][name].get("rounds")]
        if not runs:  # a row that failed in every run (its record has no rounds)
            continue
        walls = [x for r in runs for x in round_ratios(r["records"][name]["rounds"])]
        cpus = [x for r in runs for x in round_ratios(r["records"][name]["rounds"], "cpu")]
        low, high = bootstrap_median(walls)
        pooled[name] = PooledRow(
            median=statistics.median(walls),
            low=low,
            high=high,
            cpu_median=statistics.median(cpus),
            rounds=len(walls),
            runs=[r["summaries"][name]["ratio"] for r in runs if name in r.get("summaries", {})],
        )
    return pooled


def _load(directories: list[str]) -> list[dict[str, Any]]:
    return [json.loads((Path(d) / "side_by_side.json").read_text()) for d in directories]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--label", nargs="+", action="append", required=True, metavar=("NAME", "RUN_DIR"),
        help="a name, then the --out-dir of each run to pool under it (repeat for another tree)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print("| row | runs | rounds | pooled median (95%) | CPU | single runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, *directories in args.label:
        for name, row in pool_rows(_load(directories)).items():
            runs = f"{min(row.runs):.2f}-{max(row.runs):.2f}x" if row.runs else ""
            print(f"| {name} | {label}: {len(row.runs)} | {row.rounds} | {row.median:.3f}x ({row.low:.3f}-"
                  f"{row.high:.3f}) | {row.cpu_median:.3f}x | {runs} |")  # fmt: skip


if __name__ == "__main__":
    main()
