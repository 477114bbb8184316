"""The load of each mixture-of-experts layer under expert parallel: tokens per expert, gathered to where they are
logged, and the imbalance they show (the most loaded expert against the mean)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["expert_load_metrics", "expert_shards_of", "take_expert_tokens"]


def expert_shards_of(strategy: Any) -> Optional[Any]:
    """The strategy's :class:`~lightning_hybrid.expert_parallel.ExpertShards`, or None without expert parallel."""
    return getattr(getattr(strategy, "parallelized", None), "experts", None)


def take_expert_tokens(strategy: Any) -> dict[str, list[int]]:
    """This rank's counts since counting was turned on, and counting off. Only the first tensor-parallel rank of each
    replica contributes: its tensor peers route the very same tokens."""
    experts = expert_shards_of(strategy)
    if experts is None:
        return {}
    experts.load.counting = False
    tokens = experts.load.take()
    return tokens if experts.mesh["tensor"].get_local_rank() == 0 else {}


def expert_load_metrics(per_rank: list[dict[str, list[int]]], per_expert: bool = True) -> dict[str, float]:
    """Every layer's tokens per expert, summed over the ranks that counted them (the data-parallel replicas; each
    pipeline stage counts its own layers), as logged metrics:

    - ``experts/<layer>/load_imbalance``: the most loaded expert's tokens over the mean (1 is perfectly even; ``E``
      would be every token on one expert), and ``experts/load_imbalance_max`` over the layers;
    - ``experts/<layer>/tokens_min`` and ``tokens_max``; with ``per_expert``, ``experts/<layer>/tokens_<i>`` for
      each expert ``i``.

    Example:
        >>> metrics = expert_load_metrics([{"l0": [3, 1]}, {"l0": [1, 3]}, {"l1": [6, 2]}], per_expert=False)
        >>> metrics["experts/l0/load_imbalance"], metrics["experts/l1/load_imbalance"]
        (1.0, 1.5)
        >>> metrics["experts/load_imbalance_max"]
        1.5
    """
    totals: dict[str, list[int]] = {}
    for counts in per_rank:
        for layer, tokens in counts.items():
            totals[layer] = [a + b for a, b in zip(totals[layer], tokens)] if layer in totals else list(tokens)
    metrics: dict[str, float] = {}
    for layer, tokens in sorted(totals.items()):
        mean = sum(tokens) / len(tokens)
        metrics[f"experts/{layer}/load_imbalance"] = max(tokens) / mean if mean else 0.0
        metrics[f"experts/{layer}/tokens_min"] = float(min(tokens))
        metrics[f"experts/{layer}/tokens_max"] = float(max(tokens))
        if per_expert:
            metrics.update({f"experts/{layer}/tokens_{i}": float(n) for i, n in enumerate(tokens)})
    if totals:
        metrics["experts/load_imbalance_max"] = max(v for k, v in metrics.items() if k.endswith("/load_imbalance"))
    return metrics
