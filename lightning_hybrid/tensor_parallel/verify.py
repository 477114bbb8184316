"""``verify_tensor_parallel``: the first batch of a tensor-parallel run, without a pipeline, checked against an unsplit
copy of the network on one rank.

A plan can split a layer in a way the forward does not expect and still run: a fused q|k|v interleaved per head
(GPTBigCode's ``c_attn``) split as three equal blocks gives every head the wrong parts, and the loss just comes out
wrong. Before the first optimizer step, every rank runs the first replica's batch once more in eval mode (no dropout,
the random state put back, nothing logged), and the reference rank (global rank 0) compares the loss and the
gradient norm (the tensor-parallel sums done, counting each element once) with the same step on its unsplit copy;
every rank raises the same :class:`~lightning_hybrid.HybridConfigError` on a mismatch. The gradients of the check are
dropped: the real step follows unchanged. The machinery is the pipeline's (``pipeline/verify.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.pipeline.verify import PipelineVerifier

__all__ = ["verify_first_step"]


def _loss(output: Any) -> Tensor:
    loss = output if isinstance(output, Tensor) else output["loss"]
    return to_plain(loss) if isinstance(loss, DTensor) else loss


def verify_first_step(
    verifier: PipelineVerifier, module: nn.Module, network: nn.Module, mode: str, args: tuple, kwargs: dict
) -> None:
    """Check the step ``mode`` of ``module`` on ``args`` against the unsplit copy (collective: every rank, at the
    first training step, before the real one).

    Example:
        >>> # verify_first_step(parallelized.verifier, module, network, "training_step", (batch, 0), {})
    """
    verifier.refresh(network)  # a checkpoint resumed since set-up changed the weights
    batch = verifier.common_microbatch(args[0])
    rest = args[1:]
    network_name = next(n for n, m in module.named_modules() if m is network)
    # eager, also with compile=True: the check is about the plan, and a compiled block would compile again for eval
    with (
        _log_muted(module),
        verifier.deterministic(module, verifier.reference),
        torch.compiler.set_stance("force_eager"),
    ):
        loss = _loss(getattr(module, mode)(batch, *rest, **kwargs))
        _gradients(module, loss)
        norm = verifier.gradient_norm(module)
        for p in module.parameters():
            p.grad = None
        reference = None
        if verifier.reference is not None:
            verifier.reference.to(loss.device)  # copied at set-up, before the model moved to its device
            verifier.measured = (float(loss.detach()), norm)

            def run_step(forward: Any) -> Tensor:
                copy = verifier.reference
                if network is module:  # the copy is the whole LightningModule: its own step runs
                    with _log_muted(copy):
                        return _loss(getattr(copy, mode)(batch, *rest, **kwargs))
                # the copy takes the network's place in its parent (not just its forward): the network's own
                # hooks (FSDP2's all-gathers under ZeRO-3) must not run on this rank alone
                with _swapped(module, network_name, copy):
                    return _loss(getattr(module, mode)(batch, *rest, **kwargs))

            reference = verifier.reference_values(run_step, module, network)
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


@contextmanager
def _log_muted(module: nn.Module) -> Iterator[None]:
    """The check's values are not the run's: ``self.log`` does nothing meanwhile."""
    attrs = module.__dict__
    previous = attrs.get("log", _MISSING)
    attrs["log"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if previous is _MISSING:
            del attrs["log"]
        else:
            attrs["log"] = previous


@contextmanager
def _swapped(module: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """``replacement`` stands at ``name`` in ``module`` meanwhile."""
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name)
    original = getattr(parent, leaf)
    setattr(parent, leaf, replacement)
    try:
        yield
    finally:
        setattr(parent, leaf, original)


_MISSING = object()
