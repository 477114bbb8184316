"""The cross-entropy of logits split over the vocabulary, exact in forward and backward, without the whole logits.

Megatron-LM's vocabulary-parallel cross-entropy: each tensor-parallel rank holds a contiguous share of the vocabulary
of every row's logits; the loss needs of each row only its maximum, its sum of exponentials, the logit of its target
(held by one rank) and, with label smoothing, the sum of its logits. One all-reduce of the maxima and one of the three
sums give every rank the row's loss; the gradient (softmax minus the smoothed one-hot) is local to each share.

Written here rather than taken from torch's ``loss_parallel()``: that context swaps the DTensor rules of
``log_softmax`` and ``nll_loss`` for as long as it is open, and must then also be open when the backward runs (in
Lightning's backward, or inside a pipeline schedule), where it also changes every other ``log_softmax`` of the step
(a KL, an entropy term) into a wrong gradient with a right value. This function needs no context: its backward is its
own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row loss ``(1 - s) * nll + s / V * sum_j(-log p_j)`` of rows ``x`` (``[N, V/tp]``, this rank's share
    starting at ``start``), zero for rows whose target is ``ignore``; computed in fp32 (fp64 for fp64 logits)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, target: Tensor, group: Any, start: int, vocab: int, ignore: int, smoothing: float
    ) -> Tensor:
        work = x.double() if x.dtype == torch.float64 else x.float()  # x itself when it is fp32
        local_vocab = work.shape[-1]
        row_max = work.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # one buffer of the share's size: the shifted logits, read for the target logits and the smoothing sums,
        # then exponentiated in place and normalized into the softmax the backward keeps
        shifted = work - row_max.unsqueeze(-1)
        del work
        valid = target != ignore
        local_target = target - start
        here = valid & (local_target >= 0) & (local_target < local_vocab)
        index = torch.where(here, local_target, torch.zeros_like(local_target)).unsqueeze(-1)
        picked = torch.where(here, shifted.gather(-1, index).squeeze(-1), torch.zeros_like(row_max))
        smoothing_sums = shifted.sum(dim=-1) if smoothing else None
        exp = shifted.exp_()
        sums = [exp.sum(dim=-1), picked] + ([smoothing_sums] if smoothing_sums is not None else [])
        totals = torch.stack(sums)  # one all-reduce for the row sums, the target logits and the smoothing sums
        if group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        log_sum = totals[0].log()
        loss = log_sum - totals[1]  # -log p(target), the row maximum cancelled out
        if smoothing:
            # -sum_j log p_j = V * log_sum - sum_j shifted_j
            loss = (1.0 - smoothing) * loss + (smoothing / vocab) * (vocab * log_sum - totals[2])
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        softmax = exp.div_(totals[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, here, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, vocab, x.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        softmax, index, here, valid = ctx.saved_tensors
        smoothing = ctx.smoothing
        # d loss / d x_j = p_j - (1 - s) [j = target] - s / V, times the row's incoming gradient (0 if ignored)
        scale = torch.where(valid, grad.to(softmax.dtype), torch.zeros_like(grad, dtype=softmax.dtype))
        g = softmax * scale.unsqueeze(-1)
        if smoothing:
            g.sub_((smoothing / ctx.vocab) * scale.unsqueeze(-1))
        hit = torch.where(here, (1.0 - smoothing) * scale, torch.zeros_like(scale))
        g.scatter_add_(-1, index, -hit.unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: Any,
    start: int,
    vocab: int,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=..., reduction=..., label_smoothing=...)`` where
    ``logits`` is this rank's share of the classes (dimension 1, or 0 for a single row), starting at class ``start``
    of ``vocab``, and the other shares are on the ranks of ``group`` (None: this rank holds every class). Every rank
    gets the loss; each rank's gradient is that of its share. Collective over ``group`` (two all-reduces of
    ``O(rows)`` values).

    Example:
        >>> import torch.nn.functional as F
        >>> x, t = torch.randn(4, 8), torch.tensor([1, 7, -100, 0])
        >>> mine = vocab_parallel_cross_entropy(x, t, None, 0, 8, label_smoothing=0.1)
        >>> torch.allclose(mine, F.cross_entropy(x, t, label_smoothing=0.1))
        True
    """
    if logits.dim() == 1:
        rows, flat_target = logits.unsqueeze(0), target.reshape(1)
    else:
        rows, flat_target = logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)
    per_row = _VocabParallelCrossEntropy.apply(rows, flat_target, group, start, vocab, ignore_index, label_smoothing)
    if reduction == "none":
        return per_row.reshape(target.shape)
    if reduction == "sum":
        return per_row.sum()
    # torch's mean: over the rows whose target is not ignored (0 / 0 = nan when all are)
    return per_row.sum() / (flat_target != ignore_index).sum()
