"""Global positions and labels for each context-parallel rank's part of the sequence: the forward pre-hooks that make
rotary (or learned) position embeddings see the tokens' positions in the whole sequence, and that shift a Hugging
Face causal LM's labels across the parts' boundaries."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.attention import AttentionCalls
from lightning_hybrid.context_parallel.exchange import ContextShard
from lightning_hybrid.pipeline.stand_in import contains_stand_in

__all__ = ["install_hf_positions", "install_litgpt_positions"]

IGNORE_INDEX = -100  # transformers' (and torch's cross_entropy's) label to skip


def _check_no_padding(mask: Any, shard: ContextShard) -> None:
    if mask is not None and isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise HybridConfigError(
            f"`context_parallel_size={shard.size}` got an attention_mask that masks tokens (padding): attention over"
            " the whole sequence applies the causal mask only. Pack the sequences without padding, or use"
            " `context_parallel_size=1` (docs/context-parallel.md)."
        )


def _shifted_labels(labels: torch.Tensor, shard: ContextShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels of the next token for this rank's tokens (the next rank's first label across the boundary;
    ignored after the last token), and the number of labels counted over every rank of the sequence, divided by
    cp: each rank's sum over its tokens divided by it is a loss whose mean over the ranks is one device's mean."""
    first = labels[:, :1].contiguous()
    firsts = [torch.empty_like(first) for _ in range(shard.size)]
    dist.all_gather(firsts, first, group=shard.group)
    following = firsts[shard.rank + 1] if shard.rank + 1 < shard.size else torch.full_like(first, IGNORE_INDEX)
    shifted = torch.cat([labels[:, 1:], following], dim=1)
    count = (shifted != IGNORE_INDEX).sum().to(torch.float32)
    dist.all_reduce(count, group=shard.group)
    return shifted, count / shard.size


class _GlobalPositions:
    """Forward pre-hook and forward hook of a transformers model: before its forward, ``position_ids`` of the whole
    sequence when not given, padding refused, a causal LM's ``labels`` shifted across the boundary; after it, a
    forward whose attention did not go through the exchange refused. Under a pipeline the user's call of the network
    runs the pre-hook (in the step, on every rank) and the stages compute on the arguments it returned. It keeps no
    reference to the model (the hooks are given it): a deep copy of the model gets hooks that serve the copy."""

    def __init__(self, model: nn.Module, shard: ContextShard, calls: AttentionCalls) -> None:
        from transformers.loss.loss_utils import ForCausalLMLoss

        self.shard, self.calls = shard, calls
        self.signature = inspect.signature(type(model).forward)
        self.causal_lm = getattr(model, "loss_function", None) is ForCausalLMLoss

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        shard, signature = self.shard, self.signature
        arguments = signature.bind_partial(model, *args, **kwargs).arguments
        arguments.pop(next(iter(signature.parameters)))  # self
        extra = arguments.pop(next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
        arguments.update(extra)
        tokens = arguments.get("input_ids")
        tokens = tokens if tokens is not None else arguments.get("inputs_embeds")
        _check_no_padding(arguments.get("attention_mask"), shard)
        if arguments.get("position_ids") is None and tokens is not None:
            batch, length = tokens.shape[:2]
            start = shard.offset(length)
            positions = torch.arange(start, start + length, device=tokens.device)
            arguments["position_ids"] = positions.unsqueeze(0).expand(batch, length)
        labels = arguments.get("labels")
        if labels is not None:
            if not self.causal_lm:
                raise HybridConfigError(
                    f"`context_parallel_size={shard.size}`: {type(model).__name__} computes its loss from `labels`"
                    " with a loss context parallel does not split exactly. Compute the loss from the logits in"
                    " training_step, or use `context_parallel_size=1` (docs/context-parallel.md)."
                )
            if arguments.get("shift_labels") is None:
                arguments["shift_labels"], count = _shifted_labels(labels, shard)
                arguments.setdefault("num_items_in_batch", count)
        self.calls.count = 0
        return (), arguments

    def after(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # under a pipeline, a rank without the output gets stand-ins for it, with no attention run for this call yet
        if self.calls.count == 0 and not contains_stand_in(output):
            raise HybridConfigError(
                f"`context_parallel_size={self.shard.size}`: {type(model).__name__}'s forward ran no attention"
                " through transformers' attention functions, so each rank attended to its own tokens only. Context"
                " parallel splits models whose attention layers call transformers' attention interface; use"
                " `context_parallel_size=1` for this one (docs/context-parallel.md)."
            )


def install_hf_positions(model: nn.Module, shard: ContextShard, calls: AttentionCalls) -> None:
    """Global positions and labels on a transformers model (the outermost one a LightningModule calls): the hooks
    of :class:`_GlobalPositions`, registered first so that the user's own pre-hooks see global positions too."""
    hooks = _GlobalPositions(model, shard, calls)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True, prepend=True)
    model.register_forward_hook(hooks.after, with_kwargs=True)


def install_litgpt_positions(gpt: nn.Module, shard: ContextShard, calls: AttentionCalls) -> None:
    """On litgpt's ``GPT``: each block gets the rotary cos/sin of its tokens' positions in the whole sequence
    (``GPT.forward`` slices them from position 0; its ``input_pos`` means a KV cache, not a training position)."""
    # litgpt's own blocks (under a pipeline, the other stages' blocks are stand-ins)
    blocks = [b for b in gpt.transformer.h if type(b).__module__.startswith("litgpt")]
    signature = inspect.signature(type(blocks[0]).forward) if blocks else None

    def block_before(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        arguments = signature.bind(block, *args, **kwargs).arguments
        arguments.pop(next(iter(signature.parameters)))  # self
        if arguments.get("input_pos") is not None:
            raise HybridConfigError(
                f"`context_parallel_size={shard.size}`: litgpt's GPT was called with `input_pos` (its KV cache),"
                " which context parallel does not split. Call it without `input_pos` to train."
            )
        length = arguments["x"].size(1)
        start = shard.offset(length)
        if start + length > gpt.cos.size(0):
            raise HybridConfigError(
                f"`context_parallel_size={shard.size}`: the sequence ({shard.size} x {length} tokens) is longer than"
                f" litgpt's GPT.max_seq_length ({gpt.cos.size(0)}). Raise `max_seq_length`."
            )
        arguments["cos"] = gpt.cos[start : start + length].unsqueeze(0)
        arguments["sin"] = gpt.sin[start : start + length].unsqueeze(0)
        return (), arguments

    def before(module: nn.Module, args: tuple) -> None:
        calls.count = 0

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        if calls.count == 0:
            raise HybridConfigError(
                f"`context_parallel_size={shard.size}`: litgpt's GPT ran no attention through"
                " `scaled_dot_product_attention`; context parallel cannot split it. Use `context_parallel_size=1`."
            )

    for block in blocks:
        block.register_forward_pre_hook(block_before, with_kwargs=True)
    gpt.register_forward_pre_hook(before)
    gpt.register_forward_hook(after)
