"""Data features under every layout, against Lightning's own ``"ddp"`` on the same data (``run_data``).

One fit trains on two loaders at once (a ``CombinedLoader``): a map-style one, which Lightning gives a
``DistributedSampler``, and an ``IterableDataset`` the user shards by ``trainer.strategy.distributed_sampler_kwargs``
(Lightning leaves iterable datasets alone); it validates only every second epoch (``check_val_every_n_epoch=2``). A
second fit of a fresh module runs with ``overfit_batches=2``. Every rank's logged rows and the weights after each fit
are gathered, so a test compares each rank with the ``"ddp"`` rank of the same data-parallel index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, IterableDataset, Subset

from examples.nanogpt import NanoGPT
from tests.features import FEATURE_MODEL, _data_rank, _floats, _parameters, _RecordingLogger, _save_per_rank
from tests.harness import SEED, make_dataset


class TwoLoaderGPT(NanoGPT):
    """nanoGPT trained on a ``CombinedLoader`` of two loaders: one network call on both batches together (a pipeline
    runs the network once per step), the loss over all their samples; a plain batch (``overfit_batches``) as is."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not isinstance(batch, dict):
            loss = self._loss(batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
            return loss
        x = torch.cat([batch["mapped"][0], batch["streamed"][0]])
        y = torch.cat([batch["mapped"][1], batch["streamed"][1]])
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), on_step=True, on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ShardedStream(IterableDataset):
    """Samples ``rank, rank + replicas, ...`` of ``data`` in order: an iterable dataset sharded the way Lightning's
    documentation asks of one, by the data-parallel replica."""

    def __init__(self, data: Any, num_replicas: int, rank: int) -> None:
        self.data, self.num_replicas, self.rank = data, num_replicas, rank

    def __iter__(self) -> Iterator[Any]:
        for index in range(self.rank, len(self.data), self.num_replicas):
            yield self.data[index]


def run_data(scenario: dict[str, Any], out_dir: Path) -> None:
    """The two fits on every rank of the launch; rank 0 saves every rank's record."""
    from lightning_hybrid import HybridStrategy

    world = int(os.environ["WORLD_SIZE"])

    def strategy() -> Any:
        spec = scenario["strategy"]
        return spec if isinstance(spec, str) else HybridStrategy(**spec)

    L.seed_everything(SEED, verbose=False)
    module = TwoLoaderGPT(**FEATURE_MODEL)
    data = make_dataset()
    mapped, streamed = Subset(data, range(0, 32)), Subset(data, range(32, 64))
    common = {"accelerator": "cpu", "devices": world, "log_every_n_steps": 1, "enable_checkpointing": False,
              "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip

    combined_logger = _RecordingLogger()
    trainer = L.Trainer(
        strategy=strategy(), logger=combined_logger, max_epochs=2, limit_train_batches=3, limit_val_batches=2,
        check_val_every_n_epoch=2, num_sanity_val_steps=0, **common,
    )  # fmt: skip

    class TwoLoaders(L.LightningDataModule):
        def train_dataloader(self) -> CombinedLoader:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs  # known once the strategy is set up
            stream = ShardedStream(streamed, kwargs["num_replicas"], kwargs["rank"])
            loaders = {"mapped": DataLoader(mapped, batch_size=2, shuffle=True), "streamed": DataLoader(stream, 2)}
            return CombinedLoader(loaders, mode="max_size_cycle")

        def val_dataloader(self) -> DataLoader:
            return DataLoader(Subset(data, range(64, 72)), batch_size=2)

    trainer.fit(module, datamodule=TwoLoaders())
    after_combined = _parameters(module)
    combined_metrics = _floats(trainer.callback_metrics)

    L.seed_everything(SEED, verbose=False)
    module = TwoLoaderGPT(**FEATURE_MODEL)  # a fresh one: this fit is about overfit_batches alone
    overfit_logger = _RecordingLogger()
    trainer = L.Trainer(
        strategy=strategy(), logger=overfit_logger, max_epochs=2, overfit_batches=2, num_sanity_val_steps=0, **common
    )
    loader = DataLoader(Subset(data, range(0, 32)), batch_size=4, shuffle=True)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=DataLoader(Subset(data, range(64, 72)), 4))
    record = {
        "combined_rows": combined_logger.rows,
        "combined_metrics": combined_metrics,
        "combined_params": after_combined,
        "overfit_rows": overfit_logger.rows,
        "overfit_metrics": _floats(trainer.callback_metrics),
        "params": _parameters(module),
        "data_rank": _data_rank(trainer),
    }
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")
