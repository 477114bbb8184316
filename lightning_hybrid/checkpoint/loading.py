"""A HybridStrategy checkpoint directory loaded into a plain LightningModule in one process (a notebook, an
evaluation script), with no process group and no separate ``consolidate`` step.

Lightning's ``LightningModule.load_from_checkpoint`` reads one file (``torch.load``); a sharded checkpoint is a
directory, on which it stops with ``IsADirectoryError``. :func:`load_from_checkpoint` takes the module class and either:
a directory is read with torch's DCP reader into one Lightning checkpoint in memory (:func:`consolidated_checkpoint`:
full weights, hyper-parameters, loops; no optimizer state) and handed to Lightning's own ``load_from_checkpoint``, so
hyper-parameters, ``strict``, ``map_location`` and the module's ``on_load_checkpoint`` work as for a file; a file goes
to Lightning unchanged. :class:`ShardedCheckpointMixin` gives a module class the same through its own
``load_from_checkpoint``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, TypeVar, Union

import torch

from lightning_hybrid.checkpoint.consolidate import consolidated_checkpoint

__all__ = ["ShardedCheckpointMixin", "load_from_checkpoint"]

T = TypeVar("T")


def _is_directory(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and Path(path).is_dir()


def load_from_checkpoint(
    cls: type[T], checkpoint_path: Union[str, os.PathLike, Any], *args: Any, verify: bool = True, **kwargs: Any
) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` (Lightning's), also for a checkpoint directory written by
    :class:`~lightning_hybrid.HybridStrategy`: its weights are read whole in this process (no process group, any
    layout it was saved in) into a Lightning checkpoint in memory, which Lightning's ``load_from_checkpoint`` then
    reads as it reads a file (``map_location``, ``hparams_file``, ``strict`` and further keyword arguments as
    Lightning takes them). ``verify``: check every file's size and hash against the checkpoint's commit record first
    (a :class:`~lightning_hybrid.checkpoint.CheckpointError` names any that differs). Memory: the whole model twice
    (the weights read, and their serialized copy Lightning reads back), as ``torch.load`` of a ``.ckpt`` holds it.

    Example:
        >>> # from lightning_hybrid import load_from_checkpoint
        >>> # model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")  # a directory written by HybridStrategy
    """
    if not _is_directory(checkpoint_path):
        return cls.load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[attr-defined]
    # Lightning reads a file or a file object: the consolidated checkpoint goes to it as one, so that everything
    # Lightning does with a checkpoint (hyper-parameters, hooks, strict loading) happens as for a .ckpt file
    buffer = io.BytesIO()
    torch.save(consolidated_checkpoint(checkpoint_path, verify=verify), buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, *args, **kwargs)  # type: ignore[attr-defined]


class ShardedCheckpointMixin:
    """Put before ``LightningModule`` in a module's bases, and its ``load_from_checkpoint`` also reads a
    :class:`~lightning_hybrid.HybridStrategy` checkpoint directory in one process (:func:`load_from_checkpoint`);
    a file is read by Lightning as before.

    Example:
        >>> import lightning as L
        >>> class MyModule(ShardedCheckpointMixin, L.LightningModule):
        ...     pass
        >>> # MyModule.load_from_checkpoint("checkpoints/last.ckpt")  # a sharded checkpoint directory
    """

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_directory(checkpoint_path):
            return load_from_checkpoint(cls, checkpoint_path, *args, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
