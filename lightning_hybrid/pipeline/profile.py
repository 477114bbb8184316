"""Per-block costs for balancing pipeline stages: parameter counts, or forward+backward time measured on the model.

The first stage also carries the input modules (embeddings), the last the output modules (norm, head); their costs
are counted on those stages.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError

__all__ = ["stage_costs"]


def _io_modules(network: nn.Module, blocks_rel: str) -> tuple[list[nn.Module], list[nn.Module]]:
    from lightning_hybrid.pipeline.stage import io_slots

    inputs, outputs = io_slots(network, blocks_rel)
    return [s.module for s in inputs], [s.module for s in outputs]


def _params(modules: list[nn.Module]) -> float:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return float(sum(seen.values()))


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up (allocations, lazy init)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def stage_costs(
    network: nn.Module, blocks_rel: str, mode: str, example_input: Any = None, repeats: int = 3
) -> tuple[list[float], float, float]:
    """(cost per block, cost of the input modules, cost of the output modules) for ``mode`` "parameters" or
    "profile" (seconds of forward+backward on ``example_input``, the network's input).

    Example:
        >>> net = nn.Sequential(nn.Embedding(10, 4), nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 10))
        >>> stage_costs(net, "1", "parameters")
        ([20.0], 40.0, 50.0)
    """
    blocks = network.get_submodule(blocks_rel)
    inputs, outputs = _io_modules(network, blocks_rel)
    if mode == "parameters":
        return [_params([b]) for b in blocks], _params(inputs), _params(outputs)
    if example_input is None:
        raise HybridConfigError(
            "`pipeline_partition='profile'` times the network on an example input: set `self.example_input_array`"
            " in your LightningModule (the network's input, e.g. a batch of token ids), or use 'parameters'."
        )
    captured: dict[int, Any] = {}

    def keep_input(index: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[index] = (args, kwargs)

        return hook

    handles = [b.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, b in enumerate(blocks)]
    args = example_input if isinstance(example_input, tuple) else (example_input,)

    def whole() -> None:
        out = network(*args)
        out = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else out.logits
        out.float().pow(2).mean().backward()

    try:
        total = _timed(whole, repeats)
    finally:
        for h in handles:
            h.remove()
    network.zero_grad(set_to_none=True)

    def block_step(block: nn.Module, inputs: tuple[tuple, dict]) -> Any:
        block_args, block_kwargs = inputs
        fresh = tuple(
            a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in block_args
        )

        def run() -> None:
            out = block(*fresh, **block_kwargs)
            out = out if isinstance(out, torch.Tensor) else out[0]
            out.float().pow(2).mean().backward()

        return run

    block_costs = [_timed(block_step(b, captured[i]), repeats) for i, b in enumerate(blocks)]
    network.zero_grad(set_to_none=True)
    rest = max(total - sum(block_costs), 0.0)
    # the input modules (embedding lookups) are cheap next to the head's matmul: split the rest by parameters of
    # matmul-bearing modules, which is where the time goes
    heavy_in = _params([m for m in inputs if not isinstance(m, nn.Embedding)])
    heavy_out = _params(outputs)
    share_out = heavy_out / (heavy_in + heavy_out) if heavy_in + heavy_out > 0 else 0.5
    return block_costs, rest * (1 - share_out), rest * share_out
