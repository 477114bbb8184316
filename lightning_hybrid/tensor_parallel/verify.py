"""``verify_tensor_parallel``: the first batch of a tensor-parallel run, without a pipeline, checked against an unsplit
copy of the network on one rank.

A plan can split a layer in a way the forward does not expect and still run: a fused q|k|v interleaved per head
(GPTBigCode's ``c_attn``) split as three equal blocks gives every head the wrong parts, and the loss just comes out
wrong. Before the first optimizer step, every rank runs the user's step on the first replica's batch up to its call of
the network, in eval mode (no dropout, the random state put back, nothing logged), and the network once on those
inputs; the reference rank (global rank 0) compares a fixed random projection of the output and its gradient norm
(the tensor-parallel sums done, counting each element once) with the same on its unsplit copy; every rank raises
the same :class:`~lightning_hybrid.HybridConfigError` on a mismatch. Nothing the step does after the network runs
(metrics, logging) is touched, and the gradients of the check are dropped: the real step follows unchanged. The
machinery is the pipeline's (``pipeline/verify.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import attribute_replaced, capture_call, tensors_in
from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.pipeline.verify import PipelineVerifier

__all__ = ["verify_first_step"]


def _projection(output: Any) -> Optional[Tensor]:
    """A scalar of the network's output that sees every element: each floating output tensor (made whole) against
    fixed random weights of its shape, the same on every rank and for the copy, divided by the sum of the terms'
    magnitudes (detached). The sum of random-signed terms can cancel to near zero, and its rounding is that of the
    terms, not of the sum: so scaled, the value lies in [-1, 1] and its rounding error is absolute, which the
    comparison's floor of 1 reads correctly (an MoE model's unscaled projection, -0.008, was refused for a
    difference of 1.4e-6 while the gradient norms agreed to 2e-9)."""
    total: Optional[Tensor] = None
    magnitude: Optional[Tensor] = None
    for i, t in enumerate(tensors_in(output)):
        t = to_plain(t) if isinstance(t, DTensor) else t
        if not t.is_floating_point():
            continue
        weights = torch.randn(tuple(t.shape), generator=torch.Generator().manual_seed(i)).to(t.device)
        terms = t.float() * weights
        term, size = terms.sum(), terms.detach().abs().sum()
        total = term if total is None else total + term
        magnitude = size if magnitude is None else magnitude + size
    if total is None or magnitude is None:
        return None
    return total / magnitude.clamp_min(torch.finfo(torch.float32).tiny)


def verify_first_step(
    verifier: PipelineVerifier, module: nn.Module, network: nn.Module, mode: str, args: tuple, kwargs: dict
) -> None:
    """Check the network of ``module`` on the inputs its step ``mode`` gives it for ``args`` against the unsplit
    copy (collective: every rank, at the first training step, before the real one). The user's step runs only up to
    its call of the network (metrics it updates afterwards, and its logging, are not touched); compared are a fixed
    random projection of the network's output and its gradient norm.

    Example:
        >>> # verify_first_step(parallelized.verifier, module, network, "training_step", (batch, 0), {})
    """
    verifier.refresh(network)  # a checkpoint resumed since set-up changed the weights
    batch = verifier.common_microbatch(args[0])
    # eager, also with compile=True: the check is about the plan, and a compiled block would compile again for eval
    with (
        attribute_replaced(module, "log", _no_log),
        verifier.deterministic(module, verifier.reference),
        torch.compiler.set_stance("force_eager"),
    ):

        def user_step() -> Any:
            return getattr(module, mode)(batch, *args[1:], **kwargs)

        captured = capture_call(network, user_step)
        value = _projection(network(*captured[0], **captured[1])) if captured is not None else None
        if value is None:  # the step calls no network, or it returns no floating tensor: nothing to compare (alike)
            return
        _gradients(module, value)
        norm = verifier.gradient_norm(module)
        for p in module.parameters():
            p.grad = None
        # the step up to the network once more, on every rank (the code before the network may hold collectives):
        # the captured inputs may carry a graph of modules outside the network (torch's nn.TransformerEncoder takes
        # the embedding's output), which the split side's backward freed; the reference's backward needs its own
        again = capture_call(network, user_step)
        reference = None
        if verifier.reference is not None:
            assert again is not None
            copy = verifier.reference
            copy.to(value.device)  # copied at set-up, before the model moved to its device
            verifier.measured = (float(value.detach()), norm)
            # the copy is called directly: the network's own hooks (FSDP2's all-gathers under ZeRO-3) must not run
            # on this rank alone
            reference = verifier.reference_values(lambda _: _projection(copy(*again[0], **again[1])), module, network)
        verifier.compare(reference)


def _gradients(module: nn.Module, loss: Tensor) -> None:
    """``p.grad`` of every parameter for ``loss``, kept out of the gradient buckets (ZeRO-2 moves a gradient into its
    shard as it accumulates, which the check must not feed): taken by ``autograd.grad`` and set by hand. Under ZeRO-3
    FSDP2 itself reduce-scatters what backward accumulates, so there the backward pass runs as usual."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        loss.backward()
        return
    params = [p for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad]
    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
        p.grad = g


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the check: its values are not the run's."""
