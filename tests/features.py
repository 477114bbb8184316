"""Lightning features under every layout, against Lightning's own ``"ddp"`` on the same data.

Under any distributed strategy Lightning replaces the training sampler with a shuffling ``DistributedSampler``, so the
truth for a feature is ``"ddp"`` with the same data-parallel size, not one device. ``run_features`` runs one scenario
in a shared launch (``tests/worker.py`` calls it for a scenario with ``"runner": "features"``): a fit with
``accumulate_grad_batches=2``, a per-step LR scheduler, validation during the fit, then ``trainer.validate``,
``trainer.test`` and ``trainer.predict``; the module logs torchmetrics objects (a metric, a ``MetricCollection``)
and plain values with every ``reduce_fx`` and ``sync_dist``. Every rank's logged values, returned values and
predictions are gathered, so a test compares each rank of a layout with the ``"ddp"`` rank of the same data-parallel
index.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, Subset

from examples.nanogpt import NanoGPT
from tests.harness import MODEL_DEFAULTS, SEED, make_dataset

FEATURE_MODEL = {**MODEL_DEFAULTS["nanogpt"], "n_layer": 4, "bias": False}  # why no biases: docs/testing.md
BATCH_SIZE = 4
TRAIN_BATCHES = 4  # per epoch and rank: two optimizer steps at accumulate_grad_batches=2
EPOCHS = 2
VAL_BATCHES = 2
EVAL_SAMPLES = 10


class FeatureGPT(NanoGPT):
    """nanoGPT written as a user logging with torchmetrics objects and every ``reduce_fx``: token accuracy as a
    metric object (training and validation), a ``SumMetric`` of correct tokens, a ``MeanMetric`` of the loss, a
    ``MetricCollection`` in validation, and the loss with sum/mean/max/min and ``sync_dist``; a per-step LR
    scheduler. (A ``SumMetric`` of the loss would count each micro-batch's mean loss: see
    docs/lightning-features.md.)"""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        classes = self.hparams.vocab_size
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro")
        self.train_correct = torchmetrics.SumMetric()
        self.train_loss_mean = torchmetrics.MeanMetric()
        self.val_metrics = torchmetrics.MetricCollection(
            {
                "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro"),
                "macro_acc": torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="macro"),
            },
            prefix="val_",
        )
        self.val_correct = torchmetrics.SumMetric()

    def _logits_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        return logits.view(-1, logits.size(-1)), y.view(-1), loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, y, loss = self._logits_loss(batch)
        self.train_acc(logits, y)  # forward: the step's value, and the epoch's state
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_correct.update((logits.argmax(-1) == y).sum())
        self.log("train_correct", self.train_correct, on_step=False, on_epoch=True)
        self.train_loss_mean(loss.detach())
        self.log("train_loss_mean_metric", self.train_loss_mean, on_step=True, on_epoch=True)
        for fx in ("sum", "mean", "max", "min"):
            self.log(f"train_loss_{fx}", loss, on_step=True, on_epoch=True, reduce_fx=fx, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits, y, loss = self._logits_loss(batch)
        self.val_metrics.update(logits, y)
        self.log_dict(self.val_metrics)
        self.val_correct.update((logits.argmax(-1) == y).sum())
        self.log("val_correct", self.val_correct)
        for fx in ("sum", "mean", "max", "min"):
            self.log(f"val_loss_{fx}", loss, reduce_fx=fx, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, _, loss = self._logits_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_loss_max", loss, reduce_fx="max", sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).argmax(-1)

    def configure_optimizers(self) -> Any:
        # SGD, not the example's AdamW: Adam's update hardly depends on the gradient's scale, so a gradient off by the
        # accumulation factor would move the weights by 3e-5 relative only; SGD's moves them by the whole factor
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        # a per-step schedule: each optimizer step changes the rate, so a wrong step count shows in the weights
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call on every rank (Lightning's loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def build_feature_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    if model != "feature_gpt":
        return None
    L.seed_everything(SEED, verbose=False)
    return FeatureGPT(**{**FEATURE_MODEL, **kwargs})


def _floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}


def run_features(scenario: dict[str, Any], out_dir: Path) -> None:
    """One scenario on every rank of the launch: fit, validate, test and predict; rank 0 saves every rank's record."""
    from lightning_hybrid import HybridStrategy

    world = int(os.environ["WORLD_SIZE"])
    spec = scenario["strategy"]
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    module = build_feature_module("feature_gpt")
    logger = _RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=logger,
        max_epochs=EPOCHS,
        limit_train_batches=TRAIN_BATCHES,
        limit_val_batches=VAL_BATCHES,
        limit_test_batches=VAL_BATCHES,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = make_dataset()
    # 5 samples per rank: a full batch and one of a single sample, fewer than the pipeline's stages
    evaluation = Subset(data, range(EVAL_SAMPLES))
    train_loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=DataLoader(evaluation, batch_size=BATCH_SIZE))
    fit_metrics = _floats(trainer.callback_metrics)
    validated = trainer.validate(module, dataloaders=DataLoader(evaluation, batch_size=BATCH_SIZE), verbose=False)
    tested = trainer.test(module, dataloaders=DataLoader(evaluation, batch_size=BATCH_SIZE), verbose=False)
    predicted = trainer.predict(module, dataloaders=DataLoader(evaluation, batch_size=BATCH_SIZE))
    record = {
        "rows": logger.rows,
        "fit_metrics": fit_metrics,
        "validated": [_floats(d) for d in validated],
        "tested": [_floats(d) for d in tested],
        "predictions": torch.cat([p.cpu() for p in predicted]),
        "data_rank": _data_rank(trainer),
        "params": _parameters(module),
    }
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        torch.save({"per_rank": records}, out_dir / f"{scenario['name']}.pt")


def _data_rank(trainer: L.Trainer) -> int:
    mesh = getattr(trainer.strategy, "device_mesh", None)
    return mesh["data"].get_local_rank() if mesh is not None else trainer.global_rank


def _parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_hybrid.checkpoint import full_tensor

    return {n: full_tensor(p).detach().clone().cpu() for n, p in module.named_parameters()}
