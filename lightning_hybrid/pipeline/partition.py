"""Splitting the block list into pipeline stages, and the stage table printed at start.

Pure functions of the model's shape and the configuration, so every rank computes the same partition (and raises
the same error) without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from lightning_hybrid.config import HybridConfigError, check_partition

__all__ = ["StagePlan", "partition_blocks", "stage_owner"]

PartitionSpec = Union[str, Sequence[int]]


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each of the ``pipeline x virtual`` stages holds; stage ``s`` lives on pipeline rank ``owner[s]``."""

    counts: tuple[int, ...]
    owner: tuple[int, ...]
    costs: tuple[float, ...] = ()
    """Estimated cost per stage (parameters or seconds), for the table."""

    def blocks(self, stage: int) -> range:
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def stage_of(self, block: int) -> int:
        """The stage that holds ``block``."""
        start = 0
        for stage, count in enumerate(self.counts):
            start += count
            if block < start:
                return stage
        raise IndexError(f"block {block} is past the {start} blocks of the plan")

    def stages_of(self, pipeline_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.owner) if r == pipeline_rank]

    def stage_sums(self, per_block: Sequence[float], first: float = 0.0, last: float = 0.0) -> tuple[float, ...]:
        """Per stage: the sum of ``per_block`` over its blocks, plus ``first`` on the first stage (the modules before
        the blocks) and ``last`` on the last (those after them).

        Example:
            >>> StagePlan((2, 1), (0, 1)).stage_sums([1.0, 2.0, 3.0], first=10.0, last=5.0)
            (13.0, 8.0)
        """
        n = len(self.counts)
        return tuple(
            sum(per_block[b] for b in self.blocks(s)) + (first if s == 0 else 0.0) + (last if s == n - 1 else 0.0)
            for s in range(n)
        )

    def format_table(self, params: Sequence[float] = (), seconds: Sequence[float] = ()) -> str:
        """The table printed at start: each stage's pipeline rank, blocks, parameters (``params``, one device's count
        per stage: :meth:`stage_sums`) and, for a measured partition, its measured seconds.

        Example:
            >>> print(StagePlan((2, 1), (0, 1)).format_table(params=[1200.0, 800.0]))
              stage rank  blocks              params
                  0    0    0-1   ( 2)         1,200
                  1    1    2-2   ( 1)           800
        """
        header = f"  {'stage':>5} {'rank':>4}  blocks        {'params':>12}" + (f" {'seconds':>12}" if seconds else "")
        lines = [header]
        for s, n in enumerate(self.counts):
            b = self.blocks(s)
            row = f"  {s:>5} {self.owner[s]:>4}  {b.start:>3}-{b.stop - 1:<3} ({n:>2})  "
            row += f"{params[s]:>12,.0f}" if params else f"{'':>12}"
            lines.append(row + (f" {seconds[s]:>12,.4g}" if seconds else ""))
        return "\n".join(line.rstrip() for line in lines)


def stage_owner(num_stages: int, pipeline_parallel_size: int, style: str = "loop") -> tuple[int, ...]:
    """Stage -> pipeline rank. ``loop``: round robin (interleaved 1F1B); ``v``: 0..p-1 then back p-1..0 (ZBV)."""
    p = pipeline_parallel_size
    if style == "v":
        return tuple(s if s < p else 2 * p - 1 - s for s in range(num_stages))
    return tuple(s % p for s in range(num_stages))


def _balanced(costs: Sequence[float], parts: int, first_extra: float, last_extra: float) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty groups minimising the largest group cost (exact DP;
    the block counts are small). The first and last groups carry the embedding / head cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost of splitting the first i blocks into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0) + (last_extra if k == parts else 0.0)
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def partition_blocks(
    num_blocks: int,
    pipeline_parallel_size: int,
    virtual_pipeline_size: int = 1,
    partition: PartitionSpec = "uniform",
    *,
    block_costs: Optional[Sequence[float]] = None,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
    owner_style: str = "loop",
) -> StagePlan:
    """Assign ``num_blocks`` blocks to ``pipeline x virtual`` stages.

    ``partition`` is ``"uniform"`` (equal counts), ``"parameters"``/``"profile"`` (balance ``block_costs`` plus the
    embedding cost on the first and the head cost on the last stage), or explicit counts per stage.

    Example:
        >>> partition_blocks(8, 2, partition="uniform").counts
        (4, 4)
        >>> partition_blocks(4, 2, partition="parameters", block_costs=[1, 1, 1, 1], last_cost=2).counts
        (3, 1)
    """
    check_partition(partition)  # before `list(partition)` below: an int would be a TypeError there
    p, v = pipeline_parallel_size, virtual_pipeline_size
    stages = p * v
    owner = stage_owner(stages, p, owner_style)
    if stages > num_blocks:
        raise HybridConfigError(
            f"pipeline_parallel_size x virtual_pipeline_size = {p} x {v} = {stages} stages, but the model has only"
            f" {num_blocks} blocks. Use at most {num_blocks} stages (every stage needs at least one block)."
        )
    if not isinstance(partition, str):
        counts = [int(c) for c in partition]
        if len(counts) != stages or sum(counts) != num_blocks or min(counts) < 1:
            raise HybridConfigError(
                f"`pipeline_partition={list(partition)}` must give {stages} positive block counts (one per stage:"
                f" pipeline_parallel_size x virtual_pipeline_size) summing to the model's {num_blocks} blocks."
            )
        return StagePlan(tuple(counts), owner)
    if partition == "uniform":
        if v > 1 and num_blocks % stages:
            raise HybridConfigError(
                f"virtual_pipeline_size={v} with pipeline_parallel_size={p} makes {stages} virtual stages, which do"
                f" not divide the model's {num_blocks} blocks. Choose sizes whose product divides {num_blocks}, or"
                " give `pipeline_partition` as a list of block counts."
            )
        base, extra = divmod(num_blocks, stages)
        # the remainder goes to the middle stages: the first holds the embedding, the last the head and the loss
        order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2)))
        counts = [base + (1 if s in order[:extra] else 0) for s in range(stages)]
        return StagePlan(tuple(counts), owner)
    if partition in ("parameters", "profile"):
        if block_costs is None or len(block_costs) != num_blocks:
            raise HybridConfigError(f"`pipeline_partition={partition!r}` needs one cost per block.")
        counts = _balanced(block_costs, stages, first_cost, last_cost)
        costs, start = [], 0
        for s, n in enumerate(counts):
            c = (
                sum(block_costs[start : start + n])
                + (first_cost if s == 0 else 0.0)
                + (last_cost if s == stages - 1 else 0.0)
            )
            costs.append(c)
            start += n
        return StagePlan(tuple(counts), owner, tuple(costs))
    raise HybridConfigError(
        f"`pipeline_partition` must be 'uniform', 'parameters', 'profile' or a list of block counts per stage, got"
        f" {partition!r}."
    )
