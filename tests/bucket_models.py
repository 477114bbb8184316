"""Modules for the gradient-bucket scenarios (tests/test_foundation.py): parameters that get no gradient on one
data-parallel rank, or on every rank."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn


def build_bucket_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``nanogpt_unused``: the nanoGPT example plus ``model.h[1].gated``, which enters the loss on data-parallel rank
    0 only (scaled by the data-parallel size, so the average over replicas is the single-device gradient), and
    ``model.h[0].unused``, which never does. Both are 2-D, so AdamW's weight decay would move them if they were
    stepped with a zero gradient instead of being skipped as on one device. ``nanogpt_manual``: the nanoGPT example
    with manual optimization. None for other names."""
    from examples.nanogpt import NanoGPT

    class Unused(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            n_embd = self.hparams.n_embd
            # registered before each block's own modules: in reverse order (the buckets') they come after them, so
            # buckets before and after them exist
            self.model.h[1].gated = nn.Parameter(torch.randn(4, n_embd) * 0.5)
            self.model.h[0].unused = nn.Parameter(torch.randn(4, n_embd) * 0.5)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = self._loss(batch)
            mesh = self.device_mesh
            rank, size = (mesh["data"].get_local_rank(), mesh["data"].size()) if mesh is not None else (0, 1)
            if rank == 0:
                loss = loss + size * 0.1 * self.model.h[1].gated.square().mean()
            return loss

    class Manual(NanoGPT):
        """The same training with manual optimization: backward runs outside ``optimizer_step``."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = self._loss(batch)
            self.manual_backward(loss)
            optimizer.step()
            return loss

    classes = {"nanogpt_unused": Unused, "nanogpt_manual": Manual}
    return classes[model](**kwargs) if model in classes else None
