"""Attention over the whole sequence on each context-parallel rank's share of the heads: the hooks that put the
head exchange (``exchange.py``) around a model's attention. Hugging Face models get an attention function of their own
in transformers' registry; litgpt's attention modules get the exchange around their torch SDPA call (a function
mode their hooks enter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.exchange import ContextShard, heads_to_sequence, sequence_to_heads

__all__ = ["ATTENTION_NAME", "AttentionCalls", "SHARD_ATTRIBUTE", "exchange_litgpt_attention", "register_hf_attention"]

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


class _WholeSequenceSDPA(TorchFunctionMode):
    """While one litgpt attention module runs: its ``F.scaled_dot_product_attention`` call, on q, k, v of every head
    ``[batch, heads, seq / cp, dim]``, becomes the exchange around the same call on the whole sequence. A function
    mode rather than a replaced method: the attention module's own code runs as written, and only this module's
    call is reached (the hooks enter the mode around its forward)."""

    def __init__(self, shard: ContextShard, calls: AttentionCalls) -> None:
        super().__init__()
        self.shard, self.calls = shard, calls

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        if (rest[0] if rest else kwargs.get("attn_mask")) is not None:
            raise HybridConfigError(
                f"`context_parallel_size={self.shard.size}`: litgpt's attention was given a mask (a KV cache or"
                " sliding window), which context parallel does not split. Train without them, or"
                " `context_parallel_size=1`."
            )
        self.calls.count += 1
        whole = _whole_sequence_attention(
            q, k, v, self.shard, lambda q, k, v: func(q, k, v, *rest, **kwargs).transpose(1, 2)
        )
        return whole.transpose(1, 2)  # SDPA's layout, [batch, heads, seq / cp, dim]: the module transposes it back


class _LitgptExchange:
    """The hooks around one litgpt attention module's forward that enter and leave a :class:`_WholeSequenceSDPA`
    (the forward hook is called also when the forward raises, so the mode never outlives the module's call)."""

    def __init__(self, shard: ContextShard, calls: AttentionCalls) -> None:
        self.shard, self.calls = shard, calls
        self.entered: list[_WholeSequenceSDPA] = []

    def before(self, module: nn.Module, args: tuple) -> None:
        mode = _WholeSequenceSDPA(self.shard, self.calls)
        mode.__enter__()
        self.entered.append(mode)

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.entered.pop().__exit__(None, None, None)


def exchange_litgpt_attention(attention: nn.Module, shard: ContextShard, calls: AttentionCalls) -> None:
    """Put the exchange around the torch SDPA call of one litgpt attention module (module hooks; see
    :class:`_WholeSequenceSDPA`)."""
    hooks = _LitgptExchange(shard, calls)
    attention.register_forward_pre_hook(hooks.before)
    attention.register_forward_hook(hooks.after, always_call=True)
