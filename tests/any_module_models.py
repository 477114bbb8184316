"""Ordinary modules with no repeated block list, for the "plain data parallel of any module" scenarios
(tests/test_any_module.py): a small CNN and an MLP, and the image-like data they train on."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

IMAGE_SHAPE = (3, 8, 8)
NUM_CLASSES = 10


def image_dataset(num_samples: int, seed: int) -> TensorDataset:
    """Deterministic synthetic images and labels (same on every process): the label is the argmax of a fixed linear
    read-out of the image, so the task is learnable."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, *IMAGE_SHAPE, generator=generator)
    readout = torch.randn(NUM_CLASSES, images[0].numel(), generator=generator)
    labels = (images.flatten(1) @ readout.T).argmax(dim=1)
    return TensorDataset(images, labels)


class _Classifier(L.LightningModule):
    """Cross-entropy on ``self.net(x)``; ``training_step`` calls the network, not ``self`` (as many modules do)."""

    def __init__(self, learning_rate: float = 1e-4, bn_replicas: int = 1) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.bn_replicas = bn_replicas

    def _forward(self, x: Tensor) -> Tensor:
        # BatchNorm in training mode normalizes with the statistics of the batch it is given: under data parallel
        # (here, as under Lightning's DDP without SyncBatchNorm) that is each replica's local batch. A run on fewer
        # replicas than `bn_replicas` (the one-device reference) feeds each replica's slice of the global batch
        # separately, which is that same computation; layers other than BatchNorm are per sample either way.
        mesh = self.device_mesh
        replicas = mesh["data"].size() if mesh is not None else 1
        chunks = self.bn_replicas // replicas
        if chunks <= 1:
            return self.net(x)
        return torch.cat([self.net(part) for part in x.chunk(chunks)])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self._forward(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class SmallCNN(_Classifier):
    """The issue's CNN: an ``nn.Sequential`` of Conv2d, ReLU, MaxPool2d, BatchNorm2d, AdaptiveAvgPool2d, Linear."""

    def __init__(self, channels: int = 8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(
            nn.Conv2d(IMAGE_SHAPE[0], channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(channels),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * channels, NUM_CLASSES),
        )


class SmallMLP(_Classifier):
    """Flatten, a Linear/GELU/Linear body (``{"body.0": "colwise", "body.2": "rowwise"}`` splits it over tensor
    parallel), a LayerNorm and a classifier head in separate attributes; a learned input scale held by the
    LightningModule itself (a parameter of no child module)."""

    def __init__(self, hidden: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        width = int(torch.tensor(IMAGE_SHAPE).prod())
        self.input_scale = nn.Parameter(torch.ones(width))
        self.body = nn.Sequential(nn.Linear(width, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.gelu(self.norm(self.body(x.flatten(1) * self.input_scale))))

    def _forward(self, x: Tensor) -> Tensor:
        return self(x)


def build_any_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``cnn`` and ``mlp`` (learning rate 1e-4 as the other test models); None for other names."""
    classes = {"cnn": SmallCNN, "mlp": SmallMLP}
    if model not in classes:
        return None
    return classes[model](**kwargs)


def monitor_record(trainer: L.Trainer, directory: Any) -> dict[str, Any]:
    """What the strategy's ``HybridMonitor`` counted: every rank's measured FLOPs per sample, and the metrics of its
    last logging step (run after the fit on every rank: one object all-gather)."""
    import torch.distributed as dist

    from lightning_hybrid.monitoring import HybridMonitor

    (monitor,) = [c for c in trainer.callbacks if isinstance(c, HybridMonitor)]
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, monitor.measured_flops_per_sample)
    return {"flops_per_sample": per_rank, "metrics": dict(monitor.last_metrics)}
