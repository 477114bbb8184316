"""Attention over the whole sequence on each context-parallel rank's share of the heads: the hooks that put the
head exchange (``exchange.py``) around a model's attention. Hugging Face models get an attention function of their own
in transformers' registry; litgpt's attention modules get their ``scaled_dot_product_attention`` wrapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.exchange import ContextShard, heads_to_sequence, sequence_to_heads

__all__ = ["ATTENTION_NAME", "AttentionCalls", "SHARD_ATTRIBUTE", "register_hf_attention", "wrap_litgpt_attention"]

ATTENTION_NAME = "lightning_hybrid_context_parallel"
"""The name of the attention function (and of its mask function) in transformers' registries."""
SHARD_ATTRIBUTE = "_context_parallel_shard"
"""The attribute of a Hugging Face attention module (set on every module of the model) holding its ContextShard."""
CALLS_ATTRIBUTE = "_context_parallel_calls"
# keyword arguments by which a transformers model asks for attention the plain causal (or full) mask does not give
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


class AttentionCalls:
    """How many attention calls went through the exchange since the last reset: a forward that ran none trained
    with attention over this rank's tokens only, and is refused."""

    def __init__(self) -> None:
        self.count = 0

    def __deepcopy__(self, memo: dict) -> AttentionCalls:
        return self


def _whole_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard, run: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """q, k, v ``[batch, heads, seq / cp, dim]`` exchanged to ``[batch, heads / cp, seq, dim]``; ``run`` returns
    attention's output ``[batch, seq, heads / cp, dim]``, exchanged back to ``[batch, seq / cp, heads, dim]``."""
    if k.size(1) != q.size(1) and k.size(1) % shard.size:
        # grouped-query attention whose key/value heads do not split over the ranks: each query head's own copy
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (heads_to_sequence(t, shard) for t in (q, k, v))
    return sequence_to_heads(run(q, k, v), shard)


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: the whole sequence's causal (or, for an encoder, full) attention with
    torch's SDPA; the mask transformers built for this rank's tokens is not used (padding is refused earlier)."""
    shard: ContextShard = getattr(module, SHARD_ATTRIBUTE)
    whole = query.size(2) * shard.size
    # a sliding window as long as the sequence masks nothing (Mistral's default of 4096 on shorter sequences)
    window = kwargs.get("sliding_window")
    asked = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if isinstance(window, int) and window >= whole:
        asked.remove("sliding_window")
    if asked:
        raise HybridConfigError(
            f"`context_parallel_size={shard.size}`: {type(module).__name__} asks attention for {asked}, which context"
            " parallel does not apply over the whole sequence yet. Use `context_parallel_size=1` for this model"
            " (docs/context-parallel.md)."
        )
    getattr(module, CALLS_ATTRIBUTE).count += 1
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # grouped-query attention in SDPA itself: k and v repeated to the query heads would be kept for backward in
        # their repeated size (measured: 11% more activation memory for a Llama with 8 query and 4 key/value heads)
        gqa = k.size(1) != q.size(1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=gqa
        )
        return out.transpose(1, 2)

    return _whole_sequence_attention(query, key, value, shard, run).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """transformers' mask interface: no mask (attention masks the whole sequence itself)."""
    return None


def register_hf_attention() -> None:
    """Put the attention function and its mask function in transformers' registries (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def wrap_litgpt_attention(attention: nn.Module, shard: ContextShard, calls: AttentionCalls) -> None:
    """Replace the ``scaled_dot_product_attention`` method of one litgpt attention module (q, k, v of every head,
    ``[batch, heads, seq / cp, dim]``, returning ``[batch, seq / cp, heads, dim]``) by the exchange around it."""
    original = attention.scaled_dot_product_attention

    def scaled_dot_product_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if mask is not None:
            raise HybridConfigError(
                f"`context_parallel_size={shard.size}`: litgpt's attention was given a mask (a KV cache or sliding"
                " window), which context parallel does not split. Train without them, or `context_parallel_size=1`."
            )
        calls.count += 1
        return _whole_sequence_attention(q, k, v, shard, lambda q, k, v: original(q, k, v, None))

    attention.scaled_dot_product_attention = scaled_dot_product_attention
