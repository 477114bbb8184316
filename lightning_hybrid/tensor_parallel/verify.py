"""``verify_tensor_parallel``: the first batch of a tensor-parallel run, without a pipeline, checked against an unsplit
copy of the network on one rank.

A plan can split a layer in a way the forward does not expect and still run: a fused q|k|v interleaved per head
(GPTBigCode's ``c_attn``) split as three equal blocks gives every head the wrong parts, and the loss just comes out
wrong. At the first training step, when the user's step calls the network, the check runs first, on that call's own
arguments (the first replica's, on every replica), before the call goes on: the network in eval mode (no dropout, the
random state put back) and the reference rank's unsplit copy each give a fixed random projection of their output
and its gradient norm (the tensor-parallel sums done, counting each element once); a mismatch makes every rank raise
the same :class:`~lightning_hybrid.HybridConfigError`, before the first optimizer step. The user's step runs once, as
on one device: nothing of it runs again, and the gradients the check makes are dropped (any already there are kept).
The machinery is the pipeline's (``pipeline/verify.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid.pipeline.boundaries import detached
from lightning_hybrid.pipeline.verify import PipelineVerifier, projection

__all__ = ["verified_at_first_call"]



@contextmanager
def verified_at_first_call(
    verifier: PipelineVerifier, module: nn.Module, network: nn.Module
) -> Generator[None, None, None]:
    """While the block runs (the first training step), the network's first call is checked against the unsplit copy
    before it goes on (collective: every rank, at that call).

    Example:
        >>> # with verified_at_first_call(parallelized.verifier, module, network):
        >>> #     output = module.training_step(batch, 0)
    """

    def check(_: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()  # once: the check calls the network itself
        _check(verifier, module, network, args, kwargs)

    handle = network.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _check(verifier: PipelineVerifier, module: nn.Module, network: nn.Module, args: tuple, kwargs: dict) -> None:
    verifier.refresh(network)  # a checkpoint resumed since set-up changed the weights
    # the inputs may carry a graph of modules outside the network (an embedding called in the step): not the check's
    args, kwargs = verifier.common_microbatch(detached((args, kwargs)))
    kept = [(p, p.grad) for p in {id(p): p for p in module.parameters()}.values()]
    # eager, also with compile=True: the check is about the plan, and a compiled block would compile again for eval
    with (
        verifier.deterministic(module, verifier.reference),
        torch.compiler.set_stance("force_eager"),
        torch.enable_grad(),
    ):
        for p, _ in kept:
            p.grad = None
        try:
            value = projection(network(*args, **kwargs))
            if value is None:  # the network returns no floating tensor: nothing to compare (alike on every rank)
                return
            _gradients(module, value)
            norm = verifier.gradient_norm(module)
        finally:
            for p, grad in kept:  # the check's gradients dropped, the step's own (gradient accumulation) kept
                p.grad = grad
        reference = None
        if verifier.reference is not None:
            copy = verifier.reference.to(value.device)  # copied at set-up, before the model moved to its device
            verifier.measured = (float(value.detach()), norm)
            # the copy is called directly: the network's own hooks (FSDP2's all-gathers under ZeRO-3) must not run
            # on this rank alone
            reference = verifier.reference_values(lambda: projection(copy(*args, **kwargs)))
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
