"""Lightning's ``ModelSummary`` under a pipeline: the whole model's counts, as one device shows them.

Lightning summarizes the LightningModule each rank holds. Tensor parallel and ZeRO-3 parameters are DTensors, whose
``numel()`` is the whole tensor's, so those counts hold already; but a pipeline rank holds only its stages, and its
summary would count a part of the model (rank 0, which prints it, the first stage). The pipeline keeps a copy of the
network as it was before the cut, on the meta device (``NetworkSplit.unsplit``; no memory): each summary reads a
shallow copy of the LightningModule with that copy in place of the split network, so the totals, the trainable count
(frozen parameters left out) and each layer's count are one device's. Tied weights are counted once, as there.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import ModelSummary
from torch import nn

from lightning_hybrid._lightning_compat import summarize_with
from lightning_hybrid._torch_compat import copy_with_child

__all__ = ["summarize_whole_model"]


def summarize_whole_model(
    callbacks: list[Any], module: nn.Module, network: nn.Module, unsplit: Optional[nn.Module]
) -> None:
    """Make every ``ModelSummary`` in ``callbacks`` count the whole model: ``module`` with ``unsplit`` (the meta copy
    of ``network`` before the cut) in the place of ``network``. Nothing changes without a copy (``unsplit`` None:
    the network could not be copied, or the user's ``configure_model`` had split it over tensor parallel already).

    Example:
        >>> # summarize_whole_model(trainer.callbacks, lightning_module, runner.network, runner.split.unsplit)
    """
    if unsplit is None:
        return
    path = next(name for name, m in module.named_modules() if m is network)
    for callback in callbacks:
        if isinstance(callback, ModelSummary):
            summarize_with(callback, lambda pl_module: _with_submodule(pl_module, path, unsplit))


def _with_submodule(root: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """A shallow copy of ``root`` whose submodule at ``path`` is ``replacement`` (the modules on the way copied
    shallowly too); ``root`` itself is left as it is. ``path`` "": ``replacement`` itself."""
    if not path:
        return replacement
    head, _, rest = path.partition(".")
    return copy_with_child(root, head, _with_submodule(root.get_submodule(head), rest, replacement))
