"""Test-only callbacks for the precision scenarios: inject an overflow into one gradient shard on one rank, and record
per rank, per step, what a skipped step must leave untouched (parameters, optimizer state, LR) and the scaler state;
a module whose fp16 activations overflow for a run of steps (an overflow storm), and a callback that imposes a loss
scale per step (the storm's reference run)."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid.dtensor import local_grad, local_tensor
from lightning_hybrid.sharding import ShardedGradientBuckets


class InjectInf(L.Callback):
    """After backward of step ``step`` (0-based), on global rank ``rank`` only, write +inf into one element of the
    first gradient that rank holds (its local shard: a tensor-parallel slice, a stage's parameter, a ZeRO-3 shard, or
    the ZeRO-2 shard that backward reduced into)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank
        self.injected_into: str = ""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self.step or dist.get_rank() != self.rank:
            return
        for name, p in pl_module.named_parameters():
            grad = local_grad(p)
            if grad is not None and grad.numel() > 0:
                grad.view(-1)[0] = float("inf")
                self.injected_into = name
                return
        # ZeRO-2 buckets: backward has already reduced the gradients into this rank's shard
        for zero in trainer.strategy.sharded_optimizers:
            if isinstance(zero.buckets, ShardedGradientBuckets):
                shard = zero.buckets.accumulated(0)
                if shard is not None and shard.numel() > 0:
                    shard[0] = float("inf")
                    self.injected_into = "ZeRO-2 gradient shard"
                    return
        raise AssertionError(f"rank {self.rank} holds no gradient to inject into")


def _digest(tensors: list[Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local_tensor(t).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepProbe(L.Callback):
    """Per optimizer step, on this rank: digests of its parameter shards and optimizer state, the loss scale, the
    skipped-step count, the learning rate and the scheduler's step count; with ``record_warnings``, the messages of
    the warnings this rank issued during the step (every one: the filter is "always", so none is hidden as a
    repeat)."""

    def __init__(self, record_warnings: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []
        if record_warnings:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
        masters = [p for g in optimizer.param_groups for p in g["params"]]
        plugin = trainer.strategy.precision_plugin
        schedulers = trainer.lr_scheduler_configs
        self.records.append(
            {
                "params": _digest(list(pl_module.parameters())),
                "optimizer": _digest(state + masters),
                "scale": plugin.loss_scale,
                "skipped": plugin.skipped_steps,
                "lr": optimizer.param_groups[0]["lr"],
                "scheduler_steps": schedulers[0].scheduler.last_epoch if schedulers else None,
                "grad_norm": trainer.strategy.last_gradient_norm,
                "ln_f_master": _master_value(trainer, pl_module, "model.ln_f.weight"),
                "warnings": [str(w.message) for w in self._caught],
            }
        )
        self._caught.clear()


class ForceScale(L.Callback):
    """Set the loss scale used by each step: ``scales[s]`` at step ``s``. The overflow storm's reference run takes
    the scales the stormed run used at the same real steps, so both round alike in fp16 (fp16 rounding depends on
    the scale, on CPU even between powers of two)."""

    def __init__(self, scales: list[float]) -> None:
        self.scales = scales

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        trainer.strategy.precision_plugin.scaler.scale = float(self.scales[trainer.global_step])


def _master_value(trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> float | None:
    """The first element of ``name``'s fp32 master copy, if this rank's ZeRO shard holds it."""
    target = dict(pl_module.named_parameters()).get(name)
    for zero in trainer.strategy.sharded_optimizers:
        for group in zero.groups:
            offset = 0
            for p in group.params:
                if p is target and group.master is not None:
                    start = zero.dp_rank * group.shard_size if zero.sharded else 0
                    if start <= offset < start + group.shard_size:
                        return float(group.master[offset - start])
                offset += local_tensor(p).numel()
    return None


def build_precision_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """The precision scenarios' modules (None for other names): the nanoGPT example with a per-step LR schedule,
    and one whose only gradient is a constant on the final norm's weight (for the tiny-update test)."""
    from examples.nanogpt import NanoGPT

    class Scheduled(NanoGPT):
        def configure_optimizers(self) -> Any:
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class TinyUpdates(NanoGPT):
        """loss = 0 x cross-entropy + sum(ln_f.weight): the final norm's weight (1.0) gets gradient 1 every step, so
        SGD moves it by exactly the learning rate, below half of bf16's spacing at 1.0 (2**-9)."""

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self._loss(batch) * 0.0 + self.model.ln_f.weight.float().sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    class Storm(Scheduled):
        """An fp16 overflow storm: at steps ``storm_start`` to ``storm_start + storm_steps - 1`` (Trainer steps, which
        count skipped ones), data-parallel replica ``storm_replica`` multiplies its fp16 logits by 1e7, so they
        overflow fp16 (max 65504) to inf and its loss and every gradient become inf/NaN; the other replicas stay
        finite. ``storm_steps=0``: the same module with no storm."""

        def __init__(self, storm_start: int = 0, storm_steps: int = 0, storm_replica: int = 0, **kw: Any) -> None:
            super().__init__(**kw)
            self.storm = range(storm_start, storm_start + storm_steps)
            self.storm_replica = storm_replica

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            logits = self(x)
            replica = self.device_mesh["data"].get_local_rank() if self.device_mesh is not None else 0
            if self.trainer.global_step in self.storm and replica == self.storm_replica:
                logits = logits * 1e7  # fp16 times a Python float stays fp16: a real overflow in the forward pass
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    classes = {"nanogpt_scheduled": Scheduled, "nanogpt_tiny_updates": TinyUpdates, "nanogpt_storm": Storm}
    if model not in classes:
        return None
    return classes[model](**kwargs)
