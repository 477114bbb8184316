"""Resuming mid-epoch at the right batch, checking that a replica's ranks receive one batch, and each context rank's
part of the sequence.

Lightning restarts a plain (non-stateful) DataLoader from its first batch when a run resumes from a checkpoint taken
inside an epoch, while counting the epoch's batches as already done: the first batches would be seen twice and the
last ones never. The loop's restored progress says how many batches of this epoch are done; the loader skips them once.
Where the checkpoint's epoch had run all its batches (an epoch-end checkpoint, ``trainer.save_checkpoint`` after a fit
that stopped), or the loader restores its own position (``state_dict``/``load_state_dict``), Lightning's loop decides
what comes next, as under DDP, and nothing is skipped.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_hybrid._lightning_compat import finished_batches_of_epoch, restores_loader_states
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel import shard_batch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SkipOnResume", "check_replica_batches", "release_quieted", "sequence_part", "skip_finished_batches"]


def _fingerprint(batch: Any, device: torch.device) -> torch.Tensor:
    """[elements, sum, position-weighted sum] over the batch's tensors (float64)."""
    parts: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, parts.append)
    out = torch.zeros(3, dtype=torch.float64, device=device)
    for t in parts:
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        out += torch.stack([out.new_tensor(flat.numel()), flat.sum(), (flat * torch.arange(1, flat.numel() + 1,
                            dtype=torch.float64, device=device)).sum()])  # fmt: skip
    return out


def check_replica_batches(batch: Any, mesh: DeviceMesh, device: torch.device) -> None:
    """Refuse, on every rank alike, a first training batch that differs between the ranks of one data-parallel
    replica (its tensor- and pipeline-parallel peers compute one model on one batch). Lightning's own sampler splits
    over the replicas; a user's sampler or dataset that shards by global rank splits over every process, and would
    train each peer on other samples in silence. Collective over the world: call it on every rank, once per fit.

    Example:
        >>> # check_replica_batches(batch, strategy.device_mesh, strategy.root_device)  # first training batch
    """
    if mesh["pipeline"].size() * mesh["tensor"].size() == 1:
        return
    mine = _fingerprint(batch, device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    ranks = mesh.mesh  # (pipeline, data, tensor) -> global rank
    for replica in range(ranks.shape[1]):
        members = ranks[:, replica, :].flatten().tolist()
        differing = [r for r in members if not torch.equal(everyone[r], everyone[members[0]])]
        if differing:
            raise HybridConfigError(
                f"The first training batch differs between global ranks {members[0]} and {differing[0]}, which belong"
                f" to one data-parallel replica (replica {replica}: ranks {members}); its tensor- and"
                " pipeline-parallel ranks must receive the identical batch. A sampler or dataset that shards by"
                " `trainer.global_rank` and `trainer.world_size` (or torch.distributed's rank) splits the data over"
                " every process instead. With `use_distributed_sampler=False`, shard by"
                " `trainer.strategy.distributed_sampler_kwargs` (its `num_replicas` and `rank` are the data-parallel"
                " size and this rank's replica); an IterableDataset likewise."
            )


def sequence_part(batch: Any, context_rank: int, context_parallel_size: int) -> Any:
    """This rank's contiguous part of the batch's sequence under context parallel (``batch`` itself without).

    Example:
        >>> sequence_part([1, 2], 0, 1)
        [1, 2]
    """
    return shard_batch(batch, context_rank, context_parallel_size) if context_parallel_size > 1 else batch


def skip_finished_batches(dataloader: Any, trainer: Any) -> Any:
    """The loader to iterate: on a resume into an interrupted epoch, one that first skips the batches of it whose step
    finished; ``dataloader`` itself otherwise: when not resuming, when the checkpoint's epoch had run all its batches
    (Lightning's loop goes on to the next epoch), and when Lightning restores the loader's own position from the
    checkpoint (a resumable loader: skipping too would skip twice).

    Where it skips, Lightning's warning that the loader is not resumable is silenced until :func:`release_quieted`
    (the strategy's teardown): the position is restored.

    Example:
        >>> from types import SimpleNamespace
        >>> skip_finished_batches([1, 2, 3], SimpleNamespace(training=False))
        [1, 2, 3]
    """
    done = finished_batches_of_epoch(trainer)
    if done <= 0 or (_resumable(dataloader) and restores_loader_states(trainer)):
        return dataloader
    _quiet(_NOT_RESUMABLE)
    return SkipOnResume(dataloader, done)


# Lightning's warning on a resume inside an epoch (training_epoch_loop.py), given after the loader was made
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not"
_quieted: list[Any] = []


def _resumable(dataloader: Any) -> bool:
    """Lightning's test for a loader it saves and restores (``lightning.fabric.utilities.types._Stateful``)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def _quiet(message: str) -> None:
    """Ignore a warning starting with ``message`` (one process-wide filter, until :func:`release_quieted`)."""
    if message not in _quieted:
        warnings.filterwarnings("ignore", message=re.escape(message))
        _quieted.append(message)


def release_quieted() -> None:
    """Drop the filters :func:`skip_finished_batches` added: a later fit of this process is warned as usual.

    Example:
        >>> release_quieted()
    """
    while _quieted:
        pattern = re.compile(re.escape(_quieted.pop()), re.I)
        warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] == pattern)]


class SkipOnResume:
    """Wraps a training DataLoader: the first iteration skips ``skip`` batches, later epochs are untouched.

    Skipping iterates the loader (the skipped batches are loaded and dropped): simple and exact for any sampler, at the
    cost of reading them once. Attribute access goes to the wrapped loader (sampler, batch size, workers).

    Example:
        >>> list(SkipOnResume([1, 2, 3], skip=1)), list(SkipOnResume([1, 2, 3], skip=0))
        ([2, 3], [1, 2, 3])
    """

    def __init__(self, loader: Any, skip: int) -> None:
        self.loader, self.skip = loader, skip

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        for _ in range(self.skip):
            next(iterator, None)
        self.skip = 0
        yield from iterator

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
