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

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import forward_replaced
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
    attrs = module.__dict__
    attrs["log"] = lambda *a, **k: None  # the check's values are not the run's: nothing is logged
    try:
        with verifier.deterministic(module, verifier.reference):
            loss = _loss(getattr(module, mode)(batch, *rest, **kwargs))
            loss.backward()
            norm = verifier.gradient_norm(module)
            for p in module.parameters():
                p.grad = None
            reference = None
            if verifier.reference is not None:
                verifier.reference.to(loss.device)  # copied at set-up, before the model moved to its device
                verifier.measured = (float(loss.detach()), norm)

                def run_step(forward: Any) -> Tensor:
                    with forward_replaced(network, forward):
                        return _loss(getattr(module, mode)(batch, *rest, **kwargs))

                reference = verifier.reference_values(run_step, module, network)
            verifier.compare(reference)
    finally:
        del attrs["log"]
