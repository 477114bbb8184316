"""Activation checkpointing per transformer block: store only block inputs, recompute the rest in backward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(root: nn.Module, block_names: list[str]) -> None:
    """Recompute each named block in the backward pass (non-reentrant ``torch.utils.checkpoint``).

    The block's ``forward`` is wrapped in place rather than the block being wrapped in a new module, so parameter
    names, and with them state dicts and checkpoints, are unchanged. Dropout masks are replayed identically because
    ``checkpoint`` restores the RNG state.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> apply_activation_checkpointing(net, ["0", "1"])
    """
    for name in block_names:
        block = root.get_submodule(name)
        forward = block.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, **kwargs):  # type: ignore[no-untyped-def]
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed  # type: ignore[method-assign]
