"""``Trainer(sync_batchnorm=True)`` under data parallel: BatchNorm statistics over the data-parallel group only.

A Lightning adapter (it reads Lightning's ``LayerSync`` plugin), called by ``parallelize``."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_hybrid._torch_compat import BatchNormBase, privateuse1_backend_name
from lightning_hybrid.config import HybridConfigError

__all__ = ["sync_batch_norm"]


def _sync_batch_norm_devices() -> tuple[str, ...]:
    # the devices torch's SyncBatchNorm computes on (its forward raises for any other in training mode)
    return ("cuda", "hpu", "xpu", privateuse1_backend_name())


def sync_batch_norm(module: nn.Module, layer_sync: Optional[Any], data_group: Any, device_type: str) -> None:
    """Turn every BatchNorm of ``module`` into torch's ``SyncBatchNorm`` over ``data_group``, in place, when the
    Trainer was given ``sync_batchnorm=True`` (``layer_sync``, Lightning's ``TorchSyncBatchNorm``).

    The group is the data-parallel one, not WORLD as in Lightning's DDP: tensor-parallel peers hold the same batch,
    and other pipeline stages hold other layers, so a world-wide reduction would count samples twice or hang.
    Raises ``HybridConfigError`` on a device torch's SyncBatchNorm does not run on (CPU), or for another
    ``LayerSync`` plugin, on every rank alike.

    Example:
        >>> from lightning.pytorch.plugins import TorchSyncBatchNorm
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> sync_batch_norm(net, TorchSyncBatchNorm(), data_group=None, device_type="cuda")
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    if layer_sync is None or not any(isinstance(m, BatchNormBase) for m in module.modules()):
        return  # nothing to synchronize (Lightning's DDP does not complain either)
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    if type(layer_sync) is not TorchSyncBatchNorm:
        raise HybridConfigError(
            f"`plugins=[{type(layer_sync).__name__}()]`: HybridStrategy synchronizes layers with torch's SyncBatchNorm"
            " over the data-parallel group only. Use `Trainer(sync_batchnorm=True)`, or synchronize in your module."
        )
    devices = _sync_batch_norm_devices()
    if device_type not in devices:
        raise HybridConfigError(
            f"`Trainer(sync_batchnorm=True)` on {device_type!r}: torch's SyncBatchNorm runs on {list(devices)} only."
            " Remove `sync_batchnorm=True` (each data-parallel replica then normalizes with its own batch's"
            " statistics, as Lightning's DDP does without it), or train on GPUs."
        )
    # replaces the BatchNorm submodules in place, keeping their parameters and running statistics
    nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=data_group)
