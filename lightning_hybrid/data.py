"""Resuming mid-epoch at the right batch.

Lightning restarts a plain (non-stateful) DataLoader from its first batch when a run resumes from a checkpoint taken
mid-epoch, while counting the epoch's batches as already done: the first batches would be seen twice and the last
ones never. The loop's restored progress says how many batches of this epoch are done; the loader skips them once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_hybrid._lightning_compat import finished_batches_of_epoch

__all__ = ["SkipOnResume", "skip_finished_batches"]


def skip_finished_batches(dataloader: Any, trainer: Any) -> Any:
    """The loader to iterate: on a mid-epoch resume, one that first skips the batches of the interrupted epoch whose
    step finished; ``dataloader`` itself otherwise (also when the interrupted epoch had finished: none to skip).

    Example:
        >>> from types import SimpleNamespace
        >>> skip_finished_batches([1, 2, 3], SimpleNamespace(training=False))
        [1, 2, 3]
    """
    done = finished_batches_of_epoch(trainer)
    size = len(dataloader) if hasattr(dataloader, "__len__") else None
    if 0 < done and (size is None or done < size):
        return SkipOnResume(dataloader, done)
    return dataloader


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
