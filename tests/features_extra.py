"""The tuner, SWA, several loggers at once and evaluation inside a fit, under every layout against Lightning's own
``"ddp"`` (``run_extras``).

One scenario per layout runs, on the same ranks, one part after another; each part records what it returned or the
error it raised, so a refusal of one part is compared too and the next part still runs:

1. ``tuner``: ``Tuner.lr_find`` (its temporary checkpoint saved and restored) then ``Tuner.scale_batch_size``
   (power mode) on the trainer the fit then uses; the weights after each tuner, the loss curve, the suggested rate
   (written into the module) and batch size;
2. ``fit``: the fit after the tuner, with CSV, TensorBoard and W&B (offline) loggers at once;
3. ``inside``: a fit of one step with a callback calling ``trainer.validate`` and ``trainer.test`` at its epoch's
   end (Lightning does not support it: the fit fails after them, under ``"ddp"`` too);
4. ``swa``: a fit with ``StochasticWeightAveraging``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from examples.nanogpt import NanoGPT
from tests.features import FEATURE_MODEL, _data_rank, _floats, _parameters, _RecordingLogger, _save_per_rank
from tests.harness import SEED, make_dataset
from tests.log_readers import read_tensorboard_scalars

EVAL_SAMPLES = 10


class TunedGPT(NanoGPT):
    """nanoGPT trained with SGD at ``self.hparams.learning_rate`` (the user writes the tuner's suggestion there)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=0.9)


class TunedData(L.LightningDataModule):
    """The training data with the ``batch_size`` attribute ``scale_batch_size`` changes."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.data = make_dataset()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Subset(self.data, range(EVAL_SAMPLES)), batch_size=4)


class EvaluateInsideFit(L.Callback):
    """Calls ``trainer.validate`` and ``trainer.test`` from a fit hook (the last epoch's end), as users try for an
    extra evaluation; keeps what each returned, or the error it raised. Lightning does not support it: under
    ``"ddp"`` both return, then the fit fails at its epoch's end (its logger connector lost the fit's results)."""

    def __init__(self) -> None:
        self.outcome: dict[str, Any] = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != trainer.max_epochs - 1 or self.outcome:
            return
        loader = DataLoader(Subset(make_dataset(), range(EVAL_SAMPLES)), batch_size=4)
        for kind in ("validate", "test"):
            evaluate = getattr(trainer, kind)
            self.outcome[kind] = _outcome(lambda e=evaluate: [_floats(d) for d in e(pl_module, loader, verbose=False)])


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """What ``run`` returned, or its error's type and first line (``{"error": ...}``)."""
    try:
        return {"value": run()}
    except Exception as error:  # noqa: BLE001 - the part's error is its result
        first = str(error).splitlines()[0] if str(error) else ""
        return {"error": f"{type(error).__name__}: {first}", "trace": traceback.format_exc()[-3000:]}


def _strategy(spec: Any) -> Any:
    from lightning_hybrid import HybridStrategy

    return spec if isinstance(spec, str) else HybridStrategy(**spec)


def _trainer(spec: Any, world: int, **kwargs: Any) -> L.Trainer:
    options = {
        "accelerator": "cpu", "devices": world, "strategy": _strategy(spec), "log_every_n_steps": 1,
        "num_sanity_val_steps": 0, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False,
    }  # fmt: skip
    return L.Trainer(**{**options, **kwargs})


def _tuner_and_fit(scenario: dict[str, Any], world: int, directory: Path) -> dict[str, Any]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.tuner import Tuner

    L.seed_everything(SEED, verbose=False)
    module = TunedGPT(**{**FEATURE_MODEL, "learning_rate": 0.05})
    data = TunedData()
    recording = _RecordingLogger()
    loggers = [
        CSVLogger(save_dir=str(directory), name="csv", version=0),
        TensorBoardLogger(save_dir=str(directory), name="tb", version=0),
        WandbLogger(save_dir=str(directory), offline=True, project="features"),
        recording,
    ]
    trainer = _trainer(
        scenario["strategy"], world, logger=loggers, max_epochs=2, limit_train_batches=2,
        limit_val_batches=1, default_root_dir=str(directory),
    )  # fmt: skip
    record: dict[str, Any] = {"initial": _parameters(module)}
    tuner = Tuner(trainer)

    def find_rate() -> dict[str, Any]:
        finder = tuner.lr_find(
            module, datamodule=data, min_lr=1e-3, max_lr=1.0, num_training=4, early_stop_threshold=None,
            update_attr=False,
        )  # fmt: skip
        suggestion = float(finder.suggestion(skip_begin=1, skip_end=1))
        module.hparams.learning_rate = suggestion  # as the user takes it (update_attr needs 12 points or more)
        left = sorted(p.name for p in directory.glob(".lr_find*"))  # the tuner's checkpoint is removed
        return {"losses": [float(v) for v in finder.results["loss"]], "suggestion": suggestion, "left": left}

    record["lr_find"] = _outcome(find_rate)
    record["after_lr_find"] = _parameters(module)
    record["rate"] = float(module.hparams.learning_rate)
    record["scale"] = _outcome(
        lambda: tuner.scale_batch_size(module, datamodule=data, mode="power", steps_per_trial=1, max_trials=2)
    )
    record["after_scale"] = _parameters(module)
    record["batch_size"] = data.batch_size
    record["fit"] = _outcome(lambda: trainer.fit(module, datamodule=data))
    record["rows"] = recording.rows
    record["fit_metrics"] = _floats(trainer.callback_metrics)
    record["params"] = _parameters(module)
    record["data_rank"] = _data_rank(trainer)
    if dist.get_rank() == 0:
        import wandb

        wandb.finish()
        csv = directory / "csv" / "version_0" / "metrics.csv"
        record["csv"] = csv.read_text() if csv.exists() else None
        record["tensorboard"] = read_tensorboard_scalars(directory / "tb" / "version_0")
        record["wandb_dirs"] = [str(p) for p in directory.rglob("offline-run-*")]
    return record


def _inside(scenario: dict[str, Any], world: int) -> dict[str, Any]:
    """A fit of one step whose epoch's end calls ``trainer.validate`` and ``trainer.test`` (EvaluateInsideFit)."""
    L.seed_everything(SEED, verbose=False)
    module = TunedGPT(**{**FEATURE_MODEL, "learning_rate": 0.05})
    inside = EvaluateInsideFit()
    trainer = _trainer(
        scenario["strategy"], world, logger=False, max_epochs=1, limit_train_batches=1, callbacks=[inside]
    )
    outcome = _outcome(lambda: trainer.fit(module, DataLoader(make_dataset(), batch_size=4, shuffle=True)))
    return {**outcome, "inside": inside.outcome, "steps": trainer.global_step}


def _swa(scenario: dict[str, Any], world: int) -> dict[str, Any]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    L.seed_everything(SEED, verbose=False)
    module = TunedGPT(**{**FEATURE_MODEL, "learning_rate": 0.05})
    trainer = _trainer(
        scenario["strategy"], world, logger=False, max_epochs=2, limit_train_batches=2,
        callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)],
    )  # fmt: skip
    loader = DataLoader(make_dataset(), batch_size=4, shuffle=True)
    outcome = _outcome(lambda: trainer.fit(module, train_dataloaders=loader))
    outcome["steps"] = trainer.global_step
    if "error" not in outcome:
        outcome["params"] = _parameters(module)
    return outcome


def run_extras(scenario: dict[str, Any], out_dir: Path) -> None:
    """The parts of the module docstring, in order, on every rank; rank 0 saves every rank's record."""
    world = int(os.environ["WORLD_SIZE"])
    directory = out_dir / scenario["name"]
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    record: dict[str, Any] = {"tuner_and_fit": _tuner_and_fit(scenario, world, directory)}
    record["inside"] = _inside(scenario, world)
    record["swa"] = _swa(scenario, world)
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")
