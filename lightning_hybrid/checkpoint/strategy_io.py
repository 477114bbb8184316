"""HybridStrategy's checkpoint hooks (Lightning's ``Strategy`` checkpoint API): an object the strategy owns and
delegates those hooks to.

Every rank saves and loads only its own shards (``torch.distributed.checkpoint``); the model and the (ZeRO-wrapped)
optimizers load in place, after set-up.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._lightning_compat import saved_inside_epoch, unwrap_optimizer
from lightning_hybrid.checkpoint.format import read_meta
from lightning_hybrid.checkpoint.io import (
    LAYOUT_KEY,
    VERSIONS_KEY,
    ShardedCheckpointWriter,
    checkpoint_to_load,
    load_sharded,
)
from lightning_hybrid.config import CheckpointOptions

__all__ = ["StrategyCheckpoints", "checkpoint_hook"]


class StrategyCheckpoints:
    """The checkpoint half of :class:`~lightning_hybrid.HybridStrategy`: its checkpoint hooks delegate here. Reads
    the strategy's module, optimizers, ``parallelized``, ``layout``, data-parallel group and collectives.

    Arguments:
        strategy: the :class:`~lightning_hybrid.HybridStrategy` that owns this (not named in the type: the strategy
            sits above the checkpoint modules in the package's layers).
        options: its checkpoint options (``checkpoint_verify``, ...).
        writer: its checkpoint writer (``async_checkpoint``).

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> isinstance(HybridStrategy()._checkpoints, StrategyCheckpoints)
        True
    """

    def __init__(self, strategy: Any, options: CheckpointOptions, writer: ShardedCheckpointWriter) -> None:
        self.strategy, self.options, self.writer = strategy, options, writer

    def module_state_dict(self) -> dict[str, Any]:
        """The module's state with DTensors left sharded: every rank saves only its own shards."""
        strategy = self.strategy
        module = strategy.lightning_module
        state = module.state_dict()
        shared = strategy.parallelized.shared if strategy.parallelized is not None else None
        if shared is not None:  # entries another pipeline stage owns (and writes) under the same name
            state = {k: v for k, v in state.items() if k not in shared.not_owned}
        return _first_replica_buffers(module, state, strategy._data_group)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state. Collective under ZeRO-1/2 (each parameter's state is written by
        one replica): Lightning calls it on all ranks."""
        from lightning_hybrid.checkpoint.optimizer import optimizer_state as sharded_optimizer_state

        strategy = self.strategy
        raw = unwrap_optimizer(optimizer)
        shared = strategy.parallelized.shared if strategy.parallelized is not None else None
        skip = shared.not_owned if shared is not None else ()
        return sharded_optimizer_state(strategy.lightning_module, raw, strategy._sharded_for(raw), skip)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) as a sharded checkpoint directory at ``filepath`` (all ranks)."""
        import lightning

        from lightning_hybrid.checkpoint.consolidate import HUGGING_FACE_KEY, hugging_face_info

        strategy = self.strategy
        if storage_options is not None:
            raise TypeError(f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        path = Path(strategy.broadcast(str(filepath)))
        model = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        checkpoint[LAYOUT_KEY] = strategy.layout.as_dict()
        # str(): torch.__version__ is a TorchVersion, which meta.pt's weights_only load would refuse
        checkpoint[VERSIONS_KEY] = {"torch": str(torch.__version__), "lightning": lightning.__version__}
        # lets `consolidate` write a from_pretrained folder, with the pretrained folder's generation config if any
        hugging_face = hugging_face_info(strategy.lightning_module, self.options.pretrained_weights)
        if hugging_face is not None:
            checkpoint[HUGGING_FACE_KEY] = hugging_face
        self.writer.save(path, model, optimizer_states, checkpoint, is_rank_zero=strategy.is_global_zero)

    def remove(self, filepath: Any) -> None:
        """``ModelCheckpoint(save_top_k=...)`` drops an older checkpoint when it starts a newer save: with async saves
        the deletion waits until the newer one is committed, so a complete checkpoint is always on disk."""
        if self.strategy.is_global_zero:
            self.writer.remove(Path(filepath))

    def load(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint in place into the parallelized model and optimizers; returns the rest of Lightning's
        dict. A DeepSpeed checkpoint is converted to this format first (one process per node), then loaded as usual."""
        from lightning_hybrid.checkpoint.deepspeed import imported

        strategy = self.strategy
        self.writer.wait()
        path = Path(strategy.broadcast(str(checkpoint_path)))
        names = list(strategy.lightning_module.state_dict())
        token = f"{strategy.broadcast(f'{os.getpid()}-{time.time_ns()}')}-node{strategy.node_rank}"
        converts = strategy.local_rank == 0
        with imported(path, names, converts=converts, barrier=strategy.barrier, token=token) as path:
            return self._load_hybrid_checkpoint(path, weights_only)

    def _load_hybrid_checkpoint(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        strategy = self.strategy
        module = strategy.lightning_module
        verify = self.options.verify
        # ckpt_path="last" goes past a checkpoint that fails its integrity check (the files are then verified)
        path, verified = checkpoint_to_load(path, module.trainer, verify=verify)
        optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
        structure = strategy.parallelized.structure if strategy.parallelized is not None else None
        tied = structure.tied_parameters if structure is not None else []
        aliases = {**dict(tied), **{b: a for a, b in tied}}
        meta = load_sharded(
            path,
            module,
            optimizers,
            [strategy._sharded_for(o) for o in optimizers],
            aliases=aliases,
            strict=module.strict_loading,
            weights_only=weights_only,
            verify=verify and not verified,
        )
        saved_dp = read_meta(path, weights_only=weights_only).get(LAYOUT_KEY, {}).get("data_parallel_size")
        data_parallel_size = strategy.layout.data_parallel_size
        # only a resume inside an epoch counts batches of the saved layout (data.py); between epochs nothing is skipped
        if saved_dp is not None and saved_dp != data_parallel_size and saved_inside_epoch(meta):
            rank_zero_warn(
                f"Checkpoint {path} was saved inside an epoch with data_parallel_size={saved_dp}, this run has"
                f" {data_parallel_size}: model and optimizer state are resharded exactly; the epoch goes on after"
                " skipping the batches it had finished, which repeats or skips no sample only if the global batch"
                " (the DataLoader's batch_size x data_parallel_size) is the same as when it was saved."
            )
        return meta


def checkpoint_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """The strategy's Lightning checkpoint hook answered by ``method`` of the :class:`StrategyCheckpoints` it owns
    (``strategy._checkpoints``), with the method's signature and docstring: one line each in the strategy, as its step
    hooks are (``module_step.step_hook``).

    Example:
        >>> from lightning_hybrid import HybridStrategy
        >>> HybridStrategy.save_checkpoint.__doc__ == StrategyCheckpoints.save.__doc__
        True
    """

    @functools.wraps(method)
    def hook(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        return method(strategy._checkpoints, *args, **kwargs)

    return hook


def _first_replica_buffers(module: nn.Module, state: dict[str, Any], data_group: Any) -> dict[str, Any]:
    """``state`` with its persistent buffers taken from the first data-parallel replica (collective over the data
    group; the module is not changed). Each replica updates buffers such as BatchNorm's running statistics from its own
    batches; the checkpoint holds one value per key, the first replica's, as Lightning's DDP saves rank 0's."""
    if torch.distributed.get_world_size(data_group) == 1:
        return state
    names = {name for name, _ in module.named_buffers()}
    src = torch.distributed.get_global_rank(data_group, 0)
    out = dict(state)
    for key in sorted(k for k in state if k in names):  # sorted: the same order on every replica
        value = state[key]
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            out[key] = value.detach().clone()
            torch.distributed.broadcast(out[key], src=src, group=data_group)
    return out
