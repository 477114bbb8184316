"""Activation checkpointing per transformer block: store only block inputs, recompute the rest in backward."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def _is_key_value_cache(value: Any) -> bool:
    """transformers' ``Cache`` (``DynamicCache``, ...), told by its interface so transformers need not be imported."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The block's keyword arguments with no key/value cache (transformers 5.25 passes it as ``cache``, earlier
    releases as ``past_key_values``): transformers builds one whenever ``config.use_cache``, in training too, and the
    recomputed block would append its keys to it a second time (measured: the recompute attended over twice the keys
    and sliced them back). transformers' own gradient checkpointing turns the cache off in the same way."""
    if not any(_is_key_value_cache(v) for v in kwargs.values()):
        return kwargs
    return {k: (None if _is_key_value_cache(v) else v) for k, v in kwargs.items()}


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
            if torch.is_grad_enabled():
                kwargs = _without_cache(kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed  # type: ignore[method-assign]
