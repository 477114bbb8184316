"""Injected faults for checkpoint tests: a disk that fills up at a chosen point of a save, and damaged files.

``disk_full(point, rank)`` makes that rank's writer fail with ``OSError(ENOSPC)`` at one point of a save, after
writing part of the file where there is one, as a full disk does. ``disk_full_matrix`` runs a series of such saves
after a fit in every rank of a worker group (``"after_fit": "tests.checkpoint_faults:disk_full_matrix"``).
"""

from __future__ import annotations

import errno
import os
import pathlib
import time
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

# where a save can meet a full disk: the staging directory, rank 0's meta.pt, any rank's shard file, DCP's index,
# the commit record, the rename that commits
POINTS = ("staging-directory", "meta.pt", "shard", ".metadata", "commit.json", "rename")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _no_space(name: Any) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))


class _FillsUp:
    """A file that takes a few bytes, then reports a full disk (the bytes stay: a partial file is left)."""

    def __init__(self, stream: Any, room: int = 64) -> None:
        self._stream, self._room = stream, room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) <= self._room:
            self._room -= len(view)
            return self._stream.write(view)
        self._stream.write(view[: self._room])
        self._room = 0
        raise _no_space(self._stream.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _FillsUp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.close()


def _matches(point: str, path: pathlib.Path) -> bool:
    name = path.name
    return {
        "meta.pt": name == "meta.pt",
        "shard": name.endswith(".distcp"),
        ".metadata": name == ".metadata.tmp",  # DCP writes its index under this name, then renames it
        "commit.json": name == "commit.json",
    }.get(point, False)


@contextmanager
def disk_full(point: str, rank: int = 0) -> Generator[None, None, None]:
    """While active, ``rank``'s writer meets a full disk at ``point`` (one of :data:`POINTS`); other ranks write on."""
    assert point in POINTS, point
    if _rank() != rank:
        yield
        return
    open_, mkdir, replace = pathlib.Path.open, pathlib.Path.mkdir, os.replace

    def open_full(self: pathlib.Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        stream = open_(self, mode, *args, **kwargs)
        return _FillsUp(stream) if "w" in mode and _matches(point, self) else stream

    def mkdir_full(self: pathlib.Path, *args: Any, **kwargs: Any) -> None:
        if point == "staging-directory" and self.name.endswith(".partial"):
            raise _no_space(self)
        return mkdir(self, *args, **kwargs)

    def replace_full(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if point == "rename" and str(src).endswith(".partial"):
            raise _no_space(dst)
        return replace(src, dst, *args, **kwargs)

    pathlib.Path.open, pathlib.Path.mkdir, os.replace = open_full, mkdir_full, replace_full  # type: ignore[assignment]
    try:
        yield
    finally:
        pathlib.Path.open, pathlib.Path.mkdir, os.replace = open_, mkdir, replace  # type: ignore[assignment]


def flip_byte(file: Path, at: float = 0.5) -> None:
    """Flip one bit of the byte at fraction ``at`` of the file (a silent disk or copy error)."""
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


# the faults the multi-process test injects after its fit: (mode, point, failing rank)
MATRIX = [("sync", "shard", 1), ("sync", "meta.pt", 0), ("sync", "commit.json", 0), ("async", "shard", 1),
          ("async", "rename", 0)]  # fmt: skip


def disk_full_matrix(trainer: Any, directory: Path) -> dict[str, Any]:
    """After a fit that saved ``directory/last.ckpt``: each save of ``last.ckpt`` in :data:`MATRIX` meets a full disk
    on one rank. Records, for every rank, the error it raised and how long it took, then whether ``last.ckpt`` is
    still the checkpoint ``ckpt_path="last"`` picks, whole. Collective: every rank runs it."""
    from lightning_hybrid.checkpoint import checked_files, checkpoint_to_load, read_meta

    writer = trainer.strategy._checkpoint_writer
    last = directory / "last.ckpt"
    step_before, record_before = read_meta(last)["global_step"], (last / "commit.json").read_text()
    records = []
    for mode, point, rank in MATRIX:
        writer.asynchronous = mode == "async"
        start = time.monotonic()
        error = None
        with disk_full(point, rank):
            try:
                trainer.save_checkpoint(last)
                writer.wait()  # an asynchronous save reports its failure here (or at the next save, or teardown)
            except Exception as raised:
                error = f"{type(raised).__name__}: {raised}"
        records.append({"mode": mode, "point": point, "rank": rank, "error": error,
                        "seconds": time.monotonic() - start})  # fmt: skip
    writer.asynchronous = False
    chosen, _ = checkpoint_to_load(last, trainer)
    outcome = {
        "records": records,
        "step_before": step_before,
        "step_after": read_meta(last)["global_step"],
        "global_step": trainer.global_step,
        "record_unchanged": (last / "commit.json").read_text() == record_before,
        "chosen": str(chosen),
        "problems": checked_files(last),
        "left": sorted(p.name for p in directory.iterdir()),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return {"per_rank": gathered, "last": str(last)}
