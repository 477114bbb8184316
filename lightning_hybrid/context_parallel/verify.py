"""The first step of a context-parallel run checked against an unsplit copy of the network on one rank.

Attention, positions and a causal LM's ``labels=`` loss are exact under context parallel; a loss the user computes
from the logits in ``training_step`` is not always: one that shifts its targets inside the step (``logits[:, :-1]``
against ``targets[:, 1:]``) loses the pair across each part's boundary, and one that ignores tokens
(``ignore_index``) averages the context ranks' means although their counts differ. Both would train wrong in
silence. Before the first optimizer step, every rank runs the user's step on its part of the first replica's batch
(eval mode, the random state put back, nothing logged, no gradient of any parameter) and the reference rank runs it on
the whole batch with the copy of the network taken before the attention was redirected; compared are the step's loss
(the mean over the context ranks) and the norm of its gradient with respect to the network's per-token outputs (the
logits: a token dropped or weighed differently moves it by far more than the loss of an untrained model). Every rank
raises the same :class:`~lightning_hybrid.HybridConfigError` on a mismatch. The machinery (tolerance, eval mode,
agreement) is the pipeline check's (``pipeline/verify.py``).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import attribute_replaced
from lightning_hybrid.agreement import raise_together
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.batch import sequence_length, shard_batch, whole_batch
from lightning_hybrid.context_parallel.exchange import ContextShard
from lightning_hybrid.dtensor import full_tensor
from lightning_hybrid.pipeline.verify import LOSS_ERROR_FLOOR, PipelineVerifier

__all__ = ["verify_context_first_step"]


def verify_context_first_step(
    verifier: PipelineVerifier, shard: ContextShard, module: nn.Module, network_name: str, mode: str, args: tuple,
    kwargs: dict,
) -> None:  # fmt: skip
    """Compare the context-parallel loss of the first batch with the user's step on the whole batch through the
    unsplit copy (collective: every rank, at the first training step, before the real one).

    Example:
        >>> # verify_context_first_step(parallelized.verifier, shard, module, "model", "training_step", (batch, 0), {})
    """
    network = module.get_submodule(network_name)
    verifier.refresh(network)  # a checkpoint resumed since set-up changed the weights
    # the first replica's whole batch on every rank (its parts gathered over the context ranks), then this rank's part
    whole = verifier.common_microbatch(whole_batch(args[0], shard))
    length = sequence_length(whole)
    part = shard_batch(whole, shard.rank, shard.size)
    with (
        attribute_replaced(module, "log", _no_log),
        verifier.deterministic(module, verifier.reference),
        torch.compiler.set_stance("force_eager"),
    ):
        loss, square = _step(module, network, mode, (part, *args[1:]), kwargs, length // shard.size if length else 0)
        # the step's loss is the mean of the context ranks' losses: each rank's share of it, and of its gradient
        values = torch.tensor([loss / shard.size, square / shard.size**2, 1.0 if math.isfinite(loss) else 0.0])
        dist.all_reduce(values, group=shard.group)
        measured = (float(values[0]), math.sqrt(float(values[1])))
        reference = None
        if verifier.reference is not None and values[2] == shard.size:
            copy = verifier.reference
            copy.to(next((p.device for p in network.parameters()), torch.device("cpu")))
            with _network_replaced(module, network_name, copy):
                ref_loss, ref_square = _step(module, copy, mode, (whole, *args[1:]), kwargs, length)
            reference = (ref_loss, math.sqrt(ref_square))
    _compare(verifier, shard, measured, reference)


def _step(
    module: nn.Module, network: nn.Module, mode: str, args: tuple, kwargs: dict, length: int
) -> tuple[float, float]:
    """The user's step: its loss, and the squared norm of the loss's gradient with respect to the network's outputs
    of ``length`` tokens (dimension 1). The network runs without autograd; its floating outputs are made leaves, so
    that nothing of the network (nor ZeRO-3's hooks) takes part in the gradient: only the user's code after it."""
    leaves: list[Tensor] = []
    grad_was: list[bool] = []

    def before(_: nn.Module, __: Any) -> None:
        grad_was.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def after(_: nn.Module, __: Any, output: Any) -> Any:
        torch.set_grad_enabled(grad_was.pop())
        return _as_leaves(output, leaves)

    handles = [network.register_forward_pre_hook(before), network.register_forward_hook(after)]
    try:
        with torch.enable_grad():
            output = getattr(module, mode)(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        return math.nan, 0.0  # no loss to compare (alike on every rank)
    loss = full_tensor(loss) if isinstance(loss, DTensor) else loss
    per_token = [t for t in leaves if t.dim() >= 2 and t.size(1) == length]
    square = 0.0
    if per_token and loss.requires_grad:
        for g in torch.autograd.grad(loss, per_token, allow_unused=True):
            if g is not None:
                g = full_tensor(g) if isinstance(g, DTensor) else g
                square += float(g.detach().double().pow(2).sum())
    return float(loss.detach()), square


def _as_leaves(output: Any, leaves: list[Tensor]) -> Any:
    """``output`` with every floating tensor a fresh leaf that requires grad (listed in ``leaves``); a dict (a
    transformers ``ModelOutput``) is changed in place, keeping its type."""
    if isinstance(output, Tensor):
        if not output.is_floating_point():
            return output
        leaf = output.detach().requires_grad_()
        leaves.append(leaf)
        return leaf
    if isinstance(output, dict):
        for key in list(output.keys()):
            output[key] = _as_leaves(output[key], leaves)
        return output
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return type(output)(_as_leaves(v, leaves) for v in output)
    return output


@contextmanager
def _network_replaced(module: nn.Module, name: str, network: nn.Module) -> Generator[None, None, None]:
    """``module``'s submodule ``name`` (a direct child) is ``network`` meanwhile."""
    previous = module.get_submodule(name)
    setattr(module, name, network)
    try:
        yield
    finally:
        setattr(module, name, previous)


def _compare(
    verifier: PipelineVerifier, shard: ContextShard, measured: tuple[float, float],
    reference: Optional[tuple[float, float]],
) -> None:  # fmt: skip
    """Every rank raises if the reference rank found a mismatch (collective over the world)."""
    with raise_together():
        if reference is None:
            return
        (loss, norm), (ref_loss, ref_norm) = measured, reference
        verifier.result = {"loss": loss, "reference_loss": ref_loss, "norm": norm, "reference_norm": ref_norm}
        loss_err = abs(loss - ref_loss) / max(abs(ref_loss), LOSS_ERROR_FLOOR)
        norm_err = abs(norm - ref_norm) / max(abs(ref_norm), 1e-12) if ref_norm or norm else 0.0
        if not (loss_err <= verifier.tolerance and norm_err <= verifier.tolerance):
            raise HybridConfigError(
                f"`context_parallel_size={shard.size}`: the first batch's loss as context parallel computes it (the"
                " mean over the context ranks of each rank's loss on its part of the sequence) does not match"
                f" `{verifier.option}`'s unsplit run of the same step on the whole batch: loss {loss:.6g} vs"
                f" {ref_loss:.6g} (error {loss_err:.1e}), norm of its gradient at the network's outputs {norm:.6g} vs"
                f" {ref_norm:.6g} ({norm_err:.1e}); tolerance {verifier.tolerance:g}. Likely the loss in"
                " training_step shifts its targets inside the step (`logits[:, :-1]` against `targets[:, 1:]`: each"
                " part loses the pair across its boundary) or ignores tokens (`ignore_index`, masks: each rank's mean"
                " counts its own tokens, and the ranks' counts differ). Give the step targets already shifted"
                " (`(x, y)` windows) with every token counted, use the model's own loss (`labels=`, which context"
                f" parallel shifts and counts over the whole sequence), or train with `context_parallel_size=1`"
                " (docs/context-parallel.md)."
            )
    verifier.reference = None  # the copy is not needed after the first step


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the check: its values are not the run's."""
