"""Activation checkpointing per transformer block: ``"full"`` stores each block's input only and recomputes the
block in backward; ``"selective"`` keeps what is costly to recompute (matmul and attention outputs, collectives'
results) and recomputes the cheap pointwise ops (norms, activations, rotary embeddings, residual adds) - torchtitan's
op-level policy, through torch's own selective checkpointing (``create_selective_checkpoint_contexts``). Either may
apply to every ``every``-th block only."""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_hybrid.config import check_positive_int, checkpoint_mode

__all__ = ["SELECTIVE_SAVED_OPS", "SelectivePolicy", "apply_activation_checkpointing"]

# The ops whose outputs a "selective" block keeps: a linear layer's matmul, a fused attention kernel, a collective.
# Everything else is recomputed: norms, SiLU/GELU, elementwise ops, and eager attention's batched matmuls and softmax
# (the s x s scores, what Korthikanti et al.'s selective recompute drops: cheap FLOPs, the most memory).
SELECTIVE_SAVED_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::_scaled_mm", "aten::_grouped_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
    # a collective recomputed would be sent again in backward: its result is kept
    "_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor",
})  # fmt: skip


@dataclass(frozen=True)
class SelectivePolicy:
    """Which ops' outputs a selectively checkpointed block keeps; the rest are recomputed in backward.

    Example:
        >>> import torch
        >>> policy = SelectivePolicy()
        >>> policy(None, torch.ops.aten.mm.default).name, policy(None, torch.ops.aten.silu.default).name
        ('MUST_SAVE', 'PREFER_RECOMPUTE')
        >>> "aten::mm" in policy.saved_ops
        True
    """

    saved_ops: frozenset[str] = SELECTIVE_SAVED_OPS

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op.name().split(".")[0]
        return CheckpointPolicy.MUST_SAVE if name in self.saved_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _is_key_value_cache(value: Any) -> bool:
    """transformers' ``Cache`` (``DynamicCache``, ...), told by its interface so transformers need not be imported."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The block's keyword arguments with no key/value cache (transformers 5.25 passes it as ``cache``, earlier
    releases as ``past_key_values``): transformers builds one whenever ``config.use_cache``, in training too, and a
    recomputed block would append its keys to it a second time (full recompute attended over twice the keys and
    sliced them back; selective recompute met a different sequence of ops and failed). transformers' own gradient
    checkpointing turns the cache off in the same way."""
    if not any(_is_key_value_cache(v) for v in kwargs.values()):
        return kwargs
    return {k: (None if _is_key_value_cache(v) else v) for k, v in kwargs.items()}


def apply_activation_checkpointing(
    root: nn.Module,
    block_names: list[str],
    mode: Union[bool, str] = "full",
    *,
    every: int = 1,
    held: Optional[Collection[str]] = None,
    policy: Optional[SelectivePolicy] = None,
) -> list[str]:
    """Checkpoint the named blocks (non-reentrant ``torch.utils.checkpoint``): with ``mode="full"`` each keeps its
    input only, with ``"selective"`` also the outputs ``policy`` saves. ``every``: only blocks whose index in
    ``block_names`` (the model's whole block list, in order) is a multiple of it (torchtitan's "every N-th layer");
    ``held``: the blocks this rank holds (a pipeline stage's), None for all. Returns the blocks checkpointed.

    The block's ``forward`` is wrapped in place rather than the block being wrapped in a new module, so parameter
    names, and with them state dicts and checkpoints, are unchanged. Dropout masks are replayed identically because
    ``checkpoint`` restores the RNG state.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        >>> apply_activation_checkpointing(net, ["0", "1", "2"], "selective", every=2)
        ['0', '2']
    """
    chosen = checkpoint_mode(mode)
    if chosen is None:
        return []
    check_positive_int("activation_checkpointing_every", every)
    context_fn = None
    if chosen == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy or SelectivePolicy())
    checkpointed = [n for i, n in enumerate(block_names) if i % every == 0 and (held is None or n in held)]
    for name in checkpointed:
        block = root.get_submodule(name)
        forward = block.forward
        extra = {"context_fn": context_fn} if context_fn is not None else {}

        @functools.wraps(forward)
        def checkpointed_forward(*args, _forward=forward, _extra=extra, **kwargs):  # type: ignore[no-untyped-def]
            if torch.is_grad_enabled():
                kwargs = _without_cache(kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **_extra, **kwargs)

        block.forward = checkpointed_forward  # type: ignore[method-assign]
    return checkpointed
