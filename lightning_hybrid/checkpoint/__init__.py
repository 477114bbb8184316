"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes only what it holds.

A checkpoint is a directory: DCP's shard files and ``.metadata`` for the model and optimizer tensors, ``meta.pt``
(rank 0) with the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters) and the layout it
was saved with, and ``commit.json``, every file's size and SHA-256, written last. Every tensor is keyed by its
parameter's name and laid out like the parameter, ZeRO-1/2 optimizer state included, so DCP loads a checkpoint into
any tensor/pipeline/data layout and ZeRO stage.

Modules: :mod:`.tensors` (how tensors meet DCP), :mod:`.optimizer` (the layout-free optimizer state), :mod:`.format`
(reading a checkpoint's index files without running code from them), :mod:`.integrity` (each file's hash in a commit
record), :mod:`.io` (atomic and asynchronous saves, checked loads), :mod:`.consolidate` (full weights as safetensors,
Hugging Face export), :mod:`.pretrained` (starting from safetensors weights, each rank reading only its slices).
"""

from lightning_hybrid.checkpoint.consolidate import HUGGING_FACE_KEY, consolidate, hugging_face_info
from lightning_hybrid.checkpoint.format import META_FILENAME, CheckpointError, read_meta
from lightning_hybrid.checkpoint.integrity import COMMIT_FILENAME
from lightning_hybrid.checkpoint.io import (
    LAYOUT_KEY,
    VERSIONS_KEY,
    ShardedCheckpointWriter,
    checked_files,
    checkpoint_to_load,
    load_sharded,
)
from lightning_hybrid.checkpoint.optimizer import optimizer_state
from lightning_hybrid.checkpoint.pretrained import LoadReport, load_pretrained
from lightning_hybrid.checkpoint.tensors import dcp_ready
from lightning_hybrid.dtensor import full_tensor  # where it lives: the training path uses it too

__all__ = [
    "COMMIT_FILENAME",
    "HUGGING_FACE_KEY",
    "LAYOUT_KEY",
    "META_FILENAME",
    "VERSIONS_KEY",
    "CheckpointError",
    "LoadReport",
    "ShardedCheckpointWriter",
    "checked_files",
    "checkpoint_to_load",
    "consolidate",
    "dcp_ready",
    "full_tensor",
    "hugging_face_info",
    "load_pretrained",
    "load_sharded",
    "optimizer_state",
    "read_meta",
]
