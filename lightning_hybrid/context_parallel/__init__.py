"""Context parallel (docs/context-parallel.md): each sample's sequence split over ``context_parallel_size`` ranks of a
replica, attention exact over the whole sequence by an all-to-all over heads (DeepSpeed-Ulysses), positions and
labels global. :func:`plan_context_parallel` finds what to hook and refuses what it cannot split (collective-free, on
every rank alike); :func:`apply_context_parallel` installs the hooks; the strategy cuts each batch with
:func:`shard_batch`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.attention import (
    ATTENTION_NAME,
    CALLS_ATTRIBUTE,
    SHARD_ATTRIBUTE,
    AttentionCalls,
    exchange_litgpt_attention,
    register_hf_attention,
)
from lightning_hybrid.context_parallel.batch import shard_batch
from lightning_hybrid.context_parallel.exchange import ContextShard, heads_to_sequence, sequence_to_heads
from lightning_hybrid.context_parallel.positions import install_hf_positions, install_litgpt_positions

__all__ = [
    "ContextParallelPlan",
    "ContextShard",
    "apply_context_parallel",
    "heads_to_sequence",
    "plan_context_parallel",
    "sequence_to_heads",
    "shard_batch",
]

_FIX = "(docs/context-parallel.md)"


@dataclass
class ContextParallelPlan:
    """The models context parallel hooks: outermost transformers models, and litgpt GPTs."""

    huggingface: list[nn.Module] = field(default_factory=list)
    litgpt: list[nn.Module] = field(default_factory=list)


def _is_litgpt_gpt(module: nn.Module) -> bool:
    return type(module).__module__.startswith("litgpt") and hasattr(module, "transformer") and hasattr(module, "cos")


def _outermost(module: nn.Module, keep: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if keep(sub) and not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            found.append((name, sub))
    return [m for _, m in found]


def _heads(config: object) -> Optional[int]:
    for name in ("num_attention_heads", "n_head", "num_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def plan_context_parallel(module: nn.Module, cp: int, tp: int) -> ContextParallelPlan:
    """What to hook in ``module`` for ``context_parallel_size=cp`` under ``tensor_parallel_size=tp``, or a
    :class:`HybridConfigError` naming what cannot be split exactly (no collective: every rank refuses alike)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        PreTrainedModel = ()  # noqa: N806
    plan = ContextParallelPlan(
        huggingface=_outermost(module, lambda m: bool(PreTrainedModel) and isinstance(m, PreTrainedModel)),
        litgpt=_outermost(module, _is_litgpt_gpt),
    )
    if not plan.huggingface and not plan.litgpt:
        raise HybridConfigError(
            f"`context_parallel_size={cp}`: {type(module).__name__} holds no attention that context parallel can"
            " split. It splits Hugging Face transformers models (attention through transformers' attention"
            " interface, positions through `position_ids`) and litgpt's GPT; a network that computes its positions"
            f" from the length of the sequence it is given cannot be split. Use `context_parallel_size=1` {_FIX}."
        )
    for model in plan.huggingface:
        import inspect

        if "position_ids" not in inspect.signature(model.forward).parameters:
            raise HybridConfigError(
                f"`context_parallel_size={cp}`: {type(model).__name__}.forward takes no `position_ids`, so it would"
                " compute each rank's positions from its part of the sequence. Use `context_parallel_size=1` for"
                f" this model {_FIX}."
            )
    configs = [m.config for m in plan.huggingface] + [m.config for m in plan.litgpt]
    for config in configs:
        heads = _heads(config)
        if heads is not None and heads % (tp * cp):
            raise HybridConfigError(
                f"`context_parallel_size={cp}` x `tensor_parallel_size={tp}` must divide the attention heads"
                f" ({heads}): each context-parallel rank attends with heads / (tp x cp) of them. Choose sizes whose"
                f" product divides {heads} {_FIX}."
            )
    for gpt in plan.litgpt:
        config = gpt.config
        if getattr(config, "sliding_window_size", None) is not None or getattr(config, "rope_indices", None):
            raise HybridConfigError(
                f"`context_parallel_size={cp}`: this litgpt config uses sliding-window attention or per-block rotary"
                f" indices, which context parallel does not split yet. Use `context_parallel_size=1` {_FIX}."
            )
        if getattr(config, "attention_logit_softcapping", None) is not None:
            # litgpt computes soft-capped attention itself, without torch's SDPA, where the exchange is put
            raise HybridConfigError(
                f"`context_parallel_size={cp}`: this litgpt config soft-caps attention logits"
                f" (attention_logit_softcapping={config.attention_logit_softcapping}), which context parallel does"
                f" not split yet (nor does it for Hugging Face's Gemma 2). Use `context_parallel_size=1` {_FIX}."
            )
    return plan


def _attention_through_exchange(model: nn.Module) -> None:
    """Every module of ``model`` reads an attention implementation that is the exchange's: each module holding the
    model's config (or one of its sub-configs) gets a copy of it naming the exchange's attention function. The
    user's config objects are left as they are (transformers reads ``config._attn_implementation`` at every
    attention call, so the model's own config would have to be written otherwise; tensor parallel copies a config
    per attention module the same way)."""
    original = model.config
    copied = copy.deepcopy(original)
    copies = {id(original): copied}
    for key in getattr(original, "sub_configs", {}) or {}:
        sub = getattr(original, key, None)
        if sub is not None:
            copies[id(sub)] = getattr(copied, key)
    copied._attn_implementation = ATTENTION_NAME  # transformers sets it on the copy's sub-configs too
    for sub in model.modules():
        config = sub.__dict__.get("config")
        if config is not None and id(config) in copies:
            sub.config = copies[id(config)]


def apply_context_parallel(plan: ContextParallelPlan, shard: ContextShard) -> None:
    """Install the exchange around attention and the global positions on the planned models."""
    if plan.huggingface:
        register_hf_attention()
    for model in plan.huggingface:
        calls = AttentionCalls()
        for sub in model.modules():
            sub.__dict__[SHARD_ATTRIBUTE] = shard  # plain attributes: read by the attention function
            sub.__dict__[CALLS_ATTRIBUTE] = calls
        _attention_through_exchange(model)
        install_hf_positions(model, shard, calls)
    for gpt in plan.litgpt:
        calls = AttentionCalls()
        for block in gpt.transformer.h:
            if hasattr(block, "attn"):  # under a pipeline, the other stages' blocks are stand-ins
                exchange_litgpt_attention(block.attn, shard, calls)
        install_litgpt_positions(gpt, shard, calls)
