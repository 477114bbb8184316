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
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch.utils.data import DataLoader, Subset

from examples.nanogpt import NanoGPT
from lightning_hybrid import grad_norm
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
        # an explicit batch size: the epoch mean weighs each step by it (a pipeline's micro-batches must report the
        # batch's, not their own)
        self.log("train_loss_sized", loss, on_step=True, on_epoch=True, batch_size=len(batch[0]))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits, y, loss = self._logits_loss(batch)
        self.val_metrics.update(logits, y)
        self.log_dict(self.val_metrics)
        self.val_correct.update((logits.argmax(-1) == y).sum())
        self.log("val_correct", self.val_correct)
        for fx in ("sum", "mean", "max", "min"):
            self.log(f"val_loss_{fx}", loss, reduce_fx=fx, sync_dist=True)
        # batches of 4 and 1: two micro-batches and one under a pipeline, weighed by the batch's size as under ddp
        self.log("val_loss_sized", loss, batch_size=len(batch[0]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, _, loss = self._logits_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_loss_max", loss, reduce_fx="max", sync_dist=True)
        self.log("test_loss_sized", loss, batch_size=len(batch[0]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).argmax(-1)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # as Lightning's documentation shows it, with lightning_hybrid's grad_norm (Lightning's under "ddp"): each
        # parameter's gradient norm and the total, for the whole model (every second step: it gathers every gradient)
        if self.global_step % 2 == 0:
            self.log_dict(grad_norm(self, norm_type=2))

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


def _lightning_norms(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """Lightning's grad_norm called from a function outside the module's class: the set-up check does not read it."""
    return lightning_grad_norm(module, norm_type=2)


class LightningNormsGPT(FeatureGPT):
    """Lightning's own ``grad_norm`` in the hook, named there: refused at set-up where it cannot log ddp's values."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(lightning_grad_norm(self, norm_type=2))


class HiddenLightningNormsGPT(FeatureGPT):
    """Lightning's own ``grad_norm`` reached through a helper: under ZeRO-3 it fails at the first step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(_lightning_norms(self))


def build_feature_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    classes = {"feature_gpt": FeatureGPT, "lightning_norms": LightningNormsGPT, "hidden": HiddenLightningNormsGPT}
    if model not in classes:
        return None
    L.seed_everything(SEED, verbose=False)
    return classes[model](**{**FEATURE_MODEL, **kwargs})


def _floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}


def run_features(scenario: dict[str, Any], out_dir: Path) -> None:
    """One scenario on every rank of the launch: fit, validate, test and predict; rank 0 saves every rank's record."""
    from lightning_hybrid import HybridStrategy

    world = int(os.environ["WORLD_SIZE"])
    spec = scenario["strategy"]
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    module = build_feature_module(scenario.get("module", "feature_gpt"))
    logger = _RecordingLogger()
    # "microbatches": m: "ddp" with each pipeline micro-batch as a batch (batches m times smaller, m times as many
    # accumulated): the truth for what a pipeline logs once per micro-batch (a reduce_fx of sum, max or min)
    microbatches = scenario.get("microbatches", 1)
    batch_size = BATCH_SIZE // microbatches
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=logger,
        max_epochs=EPOCHS,
        limit_train_batches=TRAIN_BATCHES * microbatches,
        limit_val_batches=VAL_BATCHES * microbatches,
        limit_test_batches=VAL_BATCHES * microbatches,
        accumulate_grad_batches=2 * microbatches,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = make_dataset()
    # 5 samples per rank: a full batch and one of a single sample, fewer than the pipeline's stages
    evaluation = Subset(data, range(EVAL_SAMPLES))
    train_loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=DataLoader(evaluation, batch_size=batch_size))
    fit_metrics = _floats(trainer.callback_metrics)
    validated = trainer.validate(module, dataloaders=DataLoader(evaluation, batch_size=batch_size), verbose=False)
    tested = trainer.test(module, dataloaders=DataLoader(evaluation, batch_size=batch_size), verbose=False)
    predicted = trainer.predict(module, dataloaders=DataLoader(evaluation, batch_size=batch_size))
    record = {
        "rows": logger.rows,
        "fit_metrics": fit_metrics,
        "validated": [_floats(d) for d in validated],
        "tested": [_floats(d) for d in tested],
        "predictions": torch.cat([p.cpu() for p in predicted]),
        "data_rank": _data_rank(trainer),
        "params": _parameters(module),
    }
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")


def _save_per_rank(record: dict[str, Any], world: int, path: Path) -> None:
    """Every rank's ``record``, saved by rank 0 as ``{"per_rank": [...]}`` (collective)."""
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        torch.save({"per_rank": records}, path)


def _data_rank(trainer: L.Trainer) -> int:
    mesh = getattr(trainer.strategy, "device_mesh", None)
    return mesh["data"].get_local_rank() if mesh is not None else trainer.global_rank


def _parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_hybrid.checkpoint import full_tensor

    return {n: full_tensor(p).detach().clone().cpu() for n, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# Loops, callbacks, loggers and hooks: one module and one fit that exercise them all (``run_loops``)

LOOP_MONITOR = "val_loss_epoch/dataloader_idx_0"  # two validation loaders: Lightning suffixes the names


class LoopGPT(NanoGPT):
    """nanoGPT written as a user fine-tuning with frozen embeddings (``requires_grad_(False)``): two validation
    loaders logged on step and epoch with ``log_dict`` and every ``reduce_fx``; ``ReduceLROnPlateau`` stepped per
    optimizer step on a validation value (not there before the first validation: ``strict=False``);
    ``on_train_batch_start`` ending the second epoch early (-1); ``self.all_gather``, ``strategy.reduce`` and a
    ``sync_dist`` sum in an epoch-end hook, on the tokens each replica saw."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model.wte.requires_grad_(False)
        self.model.wpe.requires_grad_(False)
        self.tokens_seen = 0.0

    def on_train_epoch_start(self) -> None:
        self.tokens_seen = 0.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        if self.current_epoch == 1 and batch_idx == 3:
            return -1  # ends the epoch: every rank decides alike, from the batch index
        self.tokens_seen += float(batch[0].sum())
        return None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        with torch.no_grad():  # a region outside autograd, on the network's output
            accuracy = (logits.argmax(-1) == y).float().mean()
        self.log("train_accuracy_no_grad", accuracy, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log_dict({"train_loss_sum": loss}, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log_dict({"val_loss_max": loss}, reduce_fx="max", sync_dist=True)
        self.log_dict({"val_loss_min": loss}, reduce_fx="min", sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def on_train_epoch_end(self) -> None:
        seen = torch.tensor([self.tokens_seen])
        gathered = self.all_gather(seen)  # ddp: one row per replica
        self.log("gathered_rows", float(gathered.shape[0]))
        self.log("gathered_sum", gathered.sum())
        self.log("reduced_sum", self.trainer.strategy.reduce(seen.clone(), reduce_op="sum").sum())
        self.log("seen_sum_sync", seen.sum(), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        # patience 0: each step after a validation that did not improve halves the rate, visible in the weights
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        scheduler = {"scheduler": plateau, "monitor": LOOP_MONITOR, "interval": "step", "strict": False}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class LoopData(L.LightningDataModule):
    """The user's own sampler (``use_distributed_sampler=False``): each replica's share of a seeded permutation, from
    ``trainer.strategy.distributed_sampler_kwargs`` (``sharded_by``: ``"world"`` shards by global rank and world size
    instead, which gives a layout's tensor and pipeline peers different batches)."""

    def __init__(self, sharded_by: str = "strategy") -> None:
        super().__init__()
        self.sharded_by = sharded_by
        self.data = make_dataset()

    def _share(self) -> dict[str, int]:
        if self.sharded_by == "world":
            return {"num_replicas": self.trainer.world_size, "rank": self.trainer.global_rank}
        return self.trainer.strategy.distributed_sampler_kwargs

    def train_dataloader(self) -> DataLoader:
        share = self._share()
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(SEED)).tolist()
        mine = order[share["rank"] :: share["num_replicas"]]
        return DataLoader(self.data, batch_size=BATCH_SIZE, sampler=mine)

    def val_dataloader(self) -> list[DataLoader]:
        # two loaders; the second's batches (3 per rank) do not split into 2 micro-batches evenly
        first = Subset(self.data, range(EVAL_SAMPLES))
        second = Subset(self.data, range(EVAL_SAMPLES, EVAL_SAMPLES + 6))
        return [DataLoader(first, batch_size=BATCH_SIZE), DataLoader(second, batch_size=3)]


class ParameterEMA(L.Callback):
    """A user's exponential moving average of the weights: read after every batch, written into the model at each
    epoch's end (training goes on from the average)."""

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self.average: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if not p.requires_grad:
                    continue
                if name in self.average:
                    self.average[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
                else:
                    self.average[name] = p.detach().clone()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if name in self.average:
                    p.copy_(self.average[name])


class _RecordedSummary(L.pytorch.callbacks.ModelSummary):
    """Lightning's ``ModelSummary``, keeping the counts it shows (every rank computes them; rank 0 prints)."""

    counts: dict[str, Any] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        summary = self._summary(trainer, pl_module)
        self.counts = {
            "total": summary.total_parameters,
            "trainable": summary.trainable_parameters,
            "layers": dict(zip(summary.layer_names, summary.param_nums)),
        }


class _WrittenPredictions(L.pytorch.callbacks.BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
        self.written.append(prediction.detach().cpu())


def run_loops(scenario: dict[str, Any], out_dir: Path) -> None:
    """Frozen embeddings, ``val_check_interval=0.5``, sanity steps, two validation loaders, ``ReduceLROnPlateau``,
    value clipping, ModelCheckpoint (monitor, top-k, last) with EarlyStopping and LearningRateMonitor, ModelSummary,
    an EMA callback, a CSV logger, the user's sampler in a DataModule; then ``validate`` on both loaders and
    ``predict`` through a ``BasePredictionWriter`` without returned predictions. Rank 0 saves every rank's record."""
    from lightning.pytorch.callbacks import (
        EarlyStopping,
        GradientAccumulationScheduler,
        LearningRateMonitor,
        ModelCheckpoint,
        Timer,
    )
    from lightning.pytorch.loggers import CSVLogger

    from lightning_hybrid import HybridStrategy

    world = int(os.environ["WORLD_SIZE"])
    spec = scenario["strategy"]
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    L.seed_everything(SEED, verbose=False)
    module = LoopGPT(**FEATURE_MODEL)
    directory = out_dir / scenario["name"]
    checkpoint = ModelCheckpoint(
        dirpath=str(directory / "checkpoints"), monitor=LOOP_MONITOR, save_top_k=2, save_last=True,
        filename="{epoch}-{step}",
    )  # fmt: skip
    stopping = EarlyStopping(monitor=LOOP_MONITOR, patience=2)
    # every second optimizer step, all kept (a second ModelCheckpoint beside the monitoring one)
    periodic = ModelCheckpoint(
        dirpath=str(directory / "periodic"), every_n_train_steps=2, save_top_k=-1, filename="{epoch}-{step}"
    )
    # the second epoch accumulates 2 batches a step (its last batch, the third, is left over when the epoch ends)
    accumulation = GradientAccumulationScheduler(scheduling={1: 2})
    ema, summary, writer = ParameterEMA(), _RecordedSummary(max_depth=2), _WrittenPredictions()
    recording = _RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=[CSVLogger(save_dir=str(directory), name="csv", version=0), recording],
        callbacks=[
            checkpoint,
            periodic,
            stopping,
            LearningRateMonitor(logging_interval="step"),
            accumulation,
            ema,
            summary,
            writer,
        ],
        max_epochs=EPOCHS,
        max_time={"hours": 1},  # Lightning's Timer callback: it must count, and not stop the fit
        limit_train_batches=TRAIN_BATCHES,
        limit_val_batches=VAL_BATCHES,
        val_check_interval=0.5,
        num_sanity_val_steps=1,
        gradient_clip_val=0.005,
        gradient_clip_algorithm="value",
        use_distributed_sampler=False,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    data = LoopData(scenario.get("sharded_by", "strategy"))
    trainer.fit(module, datamodule=data)
    fit_metrics = _floats(trainer.callback_metrics)
    validated = trainer.validate(module, datamodule=data, verbose=False)
    evaluation = DataLoader(Subset(data.data, range(EVAL_SAMPLES)), batch_size=BATCH_SIZE)
    returned = trainer.predict(module, dataloaders=evaluation, return_predictions=False)
    csv = directory / "csv" / "version_0" / "metrics.csv"
    record = {
        "rows": recording.rows,
        "fit_metrics": fit_metrics,
        "validated": [_floats(d) for d in validated],
        "returned": returned,
        "written": torch.cat(writer.written),
        "checkpoint": {
            "best_k": {Path(k).name: float(v) for k, v in checkpoint.best_k_models.items()},
            "best": Path(checkpoint.best_model_path).name,
            "last": Path(checkpoint.last_model_path).name,
            "saved": sorted(p.name for p in (directory / "checkpoints").iterdir()),
            "periodic": sorted(p.name for p in (directory / "periodic").iterdir()),
        },
        "timer": {
            "counted": any(isinstance(c, Timer) and c.time_elapsed("train") > 0 for c in trainer.callbacks),
            "steps": trainer.global_step,
        },
        "stopping": {
            "wait": stopping.wait_count,
            "stopped_epoch": stopping.stopped_epoch,
            "best": float(stopping.best_score),
        },  # fmt: skip
        "summary": summary.counts,
        "csv": csv.read_text() if dist.get_rank() == 0 else None,
        "data_rank": _data_rank(trainer),
        "params": _parameters(module),
    }
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")


# ---------------------------------------------------------------------------------------------------------------
# Manual optimization with two optimizers (``run_manual``)


class ManualGPT(NanoGPT):
    """Manual optimization as a GAN's two players: one optimizer for the blocks and head, stepped on the loss, with
    ``self.clip_gradients`` by norm; one for the embeddings, stepped on a second forward's loss, clipped by value."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        body, embeddings = self.optimizers()
        loss = self._loss(batch)
        body.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(body, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        body.step()
        second = 0.5 * self._loss(batch)
        embeddings.zero_grad()
        self.manual_backward(second)
        self.clip_gradients(embeddings, gradient_clip_val=0.002, gradient_clip_algorithm="value")
        embeddings.step()
        self.log("loss_body", loss, sync_dist=True)
        self.log("loss_embeddings", second, sync_dist=True)

    def configure_optimizers(self) -> Any:
        embedding = {id(p) for p in (*self.model.wte.parameters(), *self.model.wpe.parameters())}
        body = [p for p in self.parameters() if id(p) not in embedding]
        embeddings = [p for p in self.parameters() if id(p) in embedding]
        return torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.SGD(embeddings, lr=0.5)


def run_manual(scenario: dict[str, Any], out_dir: Path) -> None:
    """Three manual steps with two optimizers; rank 0 saves every rank's logged rows and weights."""
    from lightning_hybrid import HybridStrategy

    world = int(os.environ["WORLD_SIZE"])
    spec = scenario["strategy"]
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    L.seed_everything(SEED, verbose=False)
    module = ManualGPT(**FEATURE_MODEL)
    logger = _RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, logger=logger, max_epochs=1, limit_train_batches=3,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(make_dataset(), batch_size=BATCH_SIZE, shuffle=True))
    record = {"rows": logger.rows, "data_rank": _data_rank(trainer), "params": _parameters(module)}
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")


def _run_data(scenario: dict[str, Any], out_dir: Path) -> None:
    from tests.features_data import run_data  # it builds on this module

    run_data(scenario, out_dir)


def _run_extras(scenario: dict[str, Any], out_dir: Path) -> None:
    from tests.features_extra import run_extras  # it builds on this module

    run_extras(scenario, out_dir)


def _run_step_shapes(scenario: dict[str, Any], out_dir: Path) -> None:
    from tests.step_shapes import run_step_shapes

    run_step_shapes(scenario, out_dir)


RUNNERS = {
    "features": run_features,
    "feature_step_shapes": _run_step_shapes,
    "feature_loops": run_loops,
    "feature_manual": run_manual,
    "feature_data": _run_data,
    "feature_extras": _run_extras,
}
