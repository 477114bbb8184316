"""Every private Lightning name lightning-hybrid uses, in one place.

Each entry says the Lightning versions it was checked on and the public API to switch to once Lightning has one. No
other module of the package imports a private Lightning name or reads a private Lightning attribute: a Lightning
release that renames one breaks this file only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

# checked on lightning 2.6.6 (2.6.x); public replacement: none yet (a public ``convert_input`` helper of Precision)
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor as convert_fp_tensor

# checked on lightning 2.6.6 (2.6.x); public replacement: none yet (``torch.distributed`` directly)
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection as destroy_dist_connection,
)

# checked on lightning 2.6.6 (2.6.x); public replacement: ``torch.distributed.is_available() and is_initialized()``
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
)

# checked on lightning 2.6.6 (2.6.x); public replacement: none yet (nccl on CUDA, gloo otherwise)
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)

# checked on lightning 2.6.6 (2.6.x); public replacement: none yet (``torch.distributed.init_process_group`` with the
# cluster environment's rank, world size and rendezvous variables)
from lightning.fabric.utilities.distributed import (
    _init_dist_connection as init_dist_connection,
)

# checked on lightning 2.6.6 (2.6.x); public replacement: none yet (Lightning's DDP/FSDP strategies build it too)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)


def ignore_known_warnings() -> None:
    """Ignore torch's ``LeafSpec`` deprecation raised from Lightning's ``CombinedLoader`` (its ``_pytree`` module
    only): Lightning flattens every run's loaders with ``LeafSpec()``, a FutureWarning on every rank of every run
    (eight copies at 2x2x2) that no user code can act on. Run at import and again as a fit starts (a user's
    ``warnings.catch_warnings`` block may have reset the filters since); idempotent.

    checked on lightning 2.6.6 with torch 2.13; remove once Lightning builds its leaf spec with torch's
    ``treespec_leaf()``.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


ignore_known_warnings()  # at import: a user's script imports the package before it builds the Trainer

__all__ = [
    "SubprocessScriptLauncher",
    "convert_fp_tensor",
    "default_process_group_backend",
    "destroy_dist_connection",
    "distributed_is_initialized",
    "finished_batches_of_epoch",
    "ignore_known_warnings",
    "init_dist_connection",
    "layer_sync",
    "lightning_optimizer",
    "module_device_mesh",
    "module_trainer",
    "restores_loader_states",
    "saved_inside_epoch",
    "summarize_with",
    "set_module_device_mesh",
    "set_launcher",
    "set_lightning_optimizers",
    "set_world_ranks",
    "unwrap_optimizer",
    "wrap_closure",
]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The user's optimizer inside a ``LightningOptimizer`` (the optimizer itself if it is not wrapped).

    ``LightningOptimizer._optimizer``: checked on lightning 2.6.6 (2.6.x); public replacement: ``.optimizer``
    (present in 2.6 as a property; switch once every supported Lightning has it).
    """
    return getattr(optimizer, "_optimizer", optimizer)


def lightning_optimizer(cls: type, optimizer: Any, strategy: Any) -> Any:
    """Lightning's wrapper of ``optimizer`` for ``strategy``, made by ``cls`` (``LightningOptimizer`` or a subclass),
    as ``Strategy.optimizers``' setter makes one.

    ``LightningOptimizer._to_lightning_optimizer``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    return cls._to_lightning_optimizer(optimizer, strategy)


def set_lightning_optimizers(strategy: Any, wrappers: list[Any]) -> None:
    """The wrappers ``LightningModule.optimizers()`` and the training loop hand out, in place of those the
    ``Strategy.optimizers`` setter made.

    ``Strategy._lightning_optimizers``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet (the
    setter always makes plain ``LightningOptimizer`` wrappers).
    """
    strategy._lightning_optimizers = wrappers


def wrap_closure(plugin: Any, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
    """Run the optimizer closure with Lightning's ``_after_closure`` hooks (``on_before_optimizer_step``, clipping).

    ``Precision._wrap_closure``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    return plugin._wrap_closure(model, optimizer, closure)


def module_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none).

    ``LightningModule._trainer``: checked on lightning 2.6.6 (2.6.x); public replacement: ``module.trainer`` once it
    returns None instead of raising.
    """
    return getattr(module, "_trainer", None)


def module_device_mesh(module: Any) -> Optional[Any]:
    """The mesh a LightningModule was given (None before; ``module.device_mesh`` raises then).

    ``LightningModule._device_mesh``: checked on lightning 2.6.6 (2.6.x); public replacement: ``module.device_mesh``
    once it returns None instead of raising.
    """
    return getattr(module, "_device_mesh", None)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``LightningModule.device_mesh`` answer with the strategy's mesh (as ``ModelParallelStrategy`` does).

    ``LightningModule._device_mesh``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    module._device_mesh = mesh


def layer_sync(strategy: Any) -> Any:
    """``Trainer(sync_batchnorm=True)``'s plugin, or None.

    ``Strategy._layer_sync``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    return strategy._layer_sync


def set_launcher(strategy: Any) -> None:
    """What a strategy's ``_configure_launcher`` hook does for processes Lightning starts itself (DDP's launcher).

    ``Strategy._configure_launcher``/``_launcher``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    if not strategy.cluster_environment.creates_processes_externally:
        env = strategy.cluster_environment
        strategy._launcher = SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


def set_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment and ``rank_zero_only`` the global rank and world size.

    A copy of ``DDPStrategy.set_world_ranks`` (not inherited: HybridStrategy is a ``ParallelStrategy``): checked on
    lightning 2.6.6 (2.6.x); public replacement: none yet (a ``ParallelStrategy`` default).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def finished_batches_of_epoch(trainer: Any) -> int:
    """On a resume into an epoch Lightning has not finished: the batches of it whose step finished, which Lightning
    counts as done while its loader starts the epoch again from its first batch (0 when not resuming, and when the
    checkpoint's epoch had run all its batches: Lightning's own loop then decides what comes next, as under DDP).

    What the fit loop restored from the checkpoint, read before its ``reset``: an epoch started but not processed
    (``fit_loop.epoch_progress.current``) is interrupted; a checkpoint taken at its last batch
    (``batch_progress.is_last_batch``) is one Lightning closes at restart. A checkpoint is taken in
    ``on_train_batch_end``, before Lightning counts the batch "completed", so the "processed" count is the one to
    skip. ``fit_loop.restarting``, ``fit_loop.epoch_progress`` and ``fit_loop.epoch_loop.batch_progress`` (loop
    progress internals): checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    if not (trainer.training and trainer.fit_loop.restarting):
        return 0
    loop = trainer.fit_loop
    epoch, batches = loop.epoch_progress.current, loop.epoch_loop.batch_progress
    if epoch.processed >= epoch.started or batches.is_last_batch:
        return 0
    return batches.current.processed


def saved_inside_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint (Lightning's dict) was taken inside an epoch that a resume goes on with: the
    checkpoint-side reading of :func:`finished_batches_of_epoch` (an epoch started, not processed, not at its last
    batch).

    ``checkpoint["loops"]["fit_loop"]`` (the loops' progress format): checked on lightning 2.6.6 (2.6.x); public
    replacement: none yet.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epoch = loop.get("epoch_progress", {}).get("current", {})
    batches = loop.get("epoch_loop.batch_progress", {})
    return epoch.get("processed", 0) < epoch.get("started", 0) and not batches.get("is_last_batch", False)


def restores_loader_states(trainer: Any) -> bool:
    """Whether the fit loop will load the training loaders' own states from the checkpoint (``state_dict`` /
    ``load_state_dict`` loaders, saved by Lightning when the checkpoint was taken): their position is then restored
    by Lightning.

    ``fit_loop._combined_loader_states_to_load``: checked on lightning 2.6.6 (2.6.x); public replacement: none yet.
    """
    return bool(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None))


def summarize_with(callback: Any, module_for: Callable[[Any], Any]) -> None:
    """Have a ``ModelSummary`` callback (and a subclass of it) summarize ``module_for(pl_module)`` instead of the
    module Lightning hands it: its ``_summary`` picks what to summarize.

    checked on lightning 2.6.6 (2.6.x); public replacement: none yet (a ``ModelSummary`` hook for the module to
    summarize, as ``DeepSpeedSummary`` is chosen there for ZeRO-3)."""
    summary = callback._summary

    def _summary(trainer: Any, pl_module: Any) -> Any:
        return summary(trainer, module_for(pl_module))

    callback._summary = _summary
