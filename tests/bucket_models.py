"""For the gradient-bucket scenarios (tests/test_foundation.py): modules with parameters that get no gradient on one
data-parallel rank, or on every rank, and a probe of the peak gradient memory during a step."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def build_bucket_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``nanogpt_unused``: the nanoGPT example plus ``model.h[1].gated``, which enters the loss on data-parallel rank
    0 only (scaled by the data-parallel size, so the average over replicas is the single-device gradient), and
    ``model.h[0].unused``, which never does. Both are 2-D, so AdamW's weight decay would move them if they were
    stepped with a zero gradient instead of being skipped as on one device. ``nanogpt_gated``: the same with ``gated``
    only. ``nanogpt_manual``: the nanoGPT example with manual optimization. None for other names."""
    from examples.nanogpt import NanoGPT

    class Unused(NanoGPT):
        with_unused = True

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            n_embd = self.hparams.n_embd
            # registered before each block's own modules: in reverse order (the buckets') they come after them, so
            # buckets before and after them exist
            self.model.h[1].gated = nn.Parameter(torch.randn(4, n_embd) * 0.5)
            if self.with_unused:
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

    class Gated(Unused):
        """Only ``gated``: ZeRO-1/2 step a flat shard, so a parameter no rank used is stepped with a zero gradient
        (AdamW's weight decay moves it) where one device skips it; a parameter some rank used is exact."""

        with_unused = False

    classes = {"nanogpt_unused": Unused, "nanogpt_gated": Gated, "nanogpt_manual": Manual}
    return classes[model](**kwargs) if model in classes else None


class _LiveBytes(TorchDispatchMode):
    """Bytes of the live storages that operators wrote while the mode was on, and their high point: each output's
    storage is tracked with a weak reference until it is freed, and the total is taken after every operator."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore  # storages not to count (the parameters: forward and backward take views of them)
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                if storage._cdata in self.ignore:
                    continue
                known = self.live.get(storage._cdata)
                if known is None or known[0].expired():
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class PeakGradientBytes(L.Callback):
    """Per optimizer step, the high point of the bytes of live tensors written during the step's backward passes and
    its gradient reduction: counting from each micro-batch's ``on_before_backward`` and, after the last one, until
    ``on_before_optimizer_step`` (after the reduction, before the step); paused from ``on_train_batch_start`` (the
    forward passes) until the next backward. What was written while counting stays counted until it is freed.

    A ``TorchDispatchMode`` sees every operator that autograd, the gradient hooks and the reduction run on this
    thread. At batch size 1 (activation gradients are small) what it counts is the gradient memory: autograd's
    gradients, bucket buffers, flat copies and shards. The parameters' storages are left out (backward takes views
    of them); a storage used only inside one operator (a workspace) is not seen."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._mode: _LiveBytes | None = None
        self._counting = False

    def _pause(self) -> None:
        if self._counting:
            assert self._mode is not None
            self._mode.__exit__(None, None, None)
            self._counting = False

    def on_train_batch_start(self, *args: Any) -> None:
        self._pause()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if self._mode is None:
            params = [p._local_tensor if isinstance(p, DTensor) else p for p in pl_module.parameters()]
            self._mode = _LiveBytes({p.untyped_storage()._cdata for p in params})
        if not self._counting:
            self._mode.__enter__()
            self._counting = True

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._mode is not None:
            self._pause()
            self.peaks.append(self._mode.peak)
            self._mode = None
