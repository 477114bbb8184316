"""Saving and loading checkpoint directories: every rank writes its own shards, and a save becomes visible at once.

A save writes into a hidden staging directory next to the target (``.NAME.partial``) and rank 0 renames it to
``NAME`` only after every rank's shards and DCP's ``.metadata`` are on disk (DCP's save ends with a gather of every
rank's write results, after which its coordinator writes ``.metadata``). A crash or kill during a save leaves the
staging directory behind and the previous ``NAME`` untouched; Lightning's ``ckpt_path="last"`` and ``ModelCheckpoint``
only look at ``*.ckpt`` names, so they never see a partial save.

A load first checks what can be checked without reading tensors, identically on every rank (the files DCP's index
names exist and are long enough; every key this rank needs is in the index with a compatible shape), and agrees on
the outcome over all ranks before DCP's collectives start, so a bad checkpoint raises the same error everywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.optim import Optimizer

from lightning_hybrid.checkpoint.consolidate import HUGGING_FACE_KEY, natural_shape_entries
from lightning_hybrid.checkpoint.format import (
    META_FILENAME,
    CheckpointError,
    SafeFileSystemReader,
    check_files,
    check_shard_files,
    read_meta,
    staging_path,
)
from lightning_hybrid.checkpoint.optimizer import HYPERPARAMETERS_KEY, optimizer_load_targets
from lightning_hybrid.checkpoint.tensors import conflicting_entries, dcp_ready, plan_load

if TYPE_CHECKING:
    from lightning_hybrid.sharding import ShardedOptimizer

__all__ = [
    "LAYOUT_KEY",
    "META_FILENAME",
    "CheckpointError",
    "ShardedCheckpointWriter",
    "flatten_state",
    "load_sharded",
    "read_meta",
]

LAYOUT_KEY = "hybrid_layout"
VERSIONS_KEY = "hybrid_versions"
OPTIMIZER_HYPERPARAMETERS_KEY = "hybrid_optimizer_param_groups"
# test-only: "RANK:N" makes that rank SIGKILL itself in the middle of its N-th save (after writing its shards, before
# the save is committed), to test that a killed save leaves the previous checkpoint intact
KILL_IN_SAVE_ENV = "LIGHTNING_HYBRID_TEST_KILL_IN_SAVE"
_saves_started = 0
_COMMIT_WAIT_S = 600.0


def _replaced_path(path: Path) -> Path:
    return path.parent / f".{path.name}.replaced"


def flatten_state(model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]) -> dict[str, Any]:
    """The DCP keys: ``state_dict.<name>``, ``optimizer_<i>.state.<param>.<stat>``, ``optimizer_<i>.master.<param>``."""
    flat = {f"state_dict.{k}": v for k, v in model_state.items()}
    for index, optimizer_state in enumerate(optimizer_states):
        for name, entries in optimizer_state.get("state", {}).items():
            for stat, value in entries.items():
                flat[f"optimizer_{index}.state.{name}.{stat}"] = value
        for name, value in optimizer_state.get("master", {}).items():
            flat[f"optimizer_{index}.master.{name}"] = value
    return flat


class _Writer(FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        kill = os.environ.get(KILL_IN_SAVE_ENV)
        if kill:
            rank, count = (int(x) for x in kill.split(":"))
            if dist.get_rank() == rank and _saves_started == count:
                future.wait()  # this rank's shards are written; the save is not committed
                os.kill(os.getpid(), signal.SIGKILL)
        return future


def _commit(staging: Path, path: Path) -> None:
    """Rank 0, once every rank's part is written: make the staging directory the checkpoint."""
    replaced = _replaced_path(path)
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)  # kept until the new one is in place: a crash here leaves it recoverable
    os.replace(staging, path)
    shutil.rmtree(replaced, ignore_errors=True)


class ShardedCheckpointWriter:
    """Writes checkpoint directories, synchronously or in the background (``asynchronous=True``).

    An asynchronous save copies this rank's shards to CPU memory (``dcp.async_save``'s staging), returns, and writes
    them in a background thread over a process group of its own (a second thread's collectives must not interleave
    with training's on the same group). The commit (rename) happens when every rank has written; the next save and
    :meth:`wait` (called at the end of training) wait for it.

    Example:
        >>> writer = ShardedCheckpointWriter(asynchronous=False)
        >>> # writer.save(Path("step=10.ckpt"), model_state, optimizer_states, meta, is_rank_zero=rank == 0)
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._pending: Optional[Any] = None
        self._staging: Optional[Path] = None
        self._is_rank_zero = False
        self._commit_thread: Optional[threading.Thread] = None
        self._commit_error: list[BaseException] = []
        self._removals: list[Path] = []  # checkpoints to delete once the pending save is committed
        self._group: Optional[Any] = None

    def save(
        self,
        path: Path,
        model_state: dict[str, Any],
        optimizer_states: list[dict[str, Any]],
        meta: dict[str, Any],
        *,
        is_rank_zero: bool,
        barrier: Callable[[], None],
    ) -> None:
        """Every rank writes its shards of ``model_state``/``optimizer_states``; rank 0 writes ``meta``. Collective."""
        import torch.distributed.checkpoint as dcp

        global _saves_started
        self.wait()
        _saves_started += 1
        staging = staging_path(path)
        meta = dict(meta)
        meta[OPTIMIZER_HYPERPARAMETERS_KEY] = [s.get(HYPERPARAMETERS_KEY, []) for s in optimizer_states]
        flat = flatten_state(model_state, optimizer_states)
        flat.update(natural_shape_entries(flat))
        flat = dcp_ready(flat)
        conflicts = conflicting_entries(flat)
        if conflicts:
            # raised on every rank alike (the check's result is shared), before any rank writes a shard
            shown = conflicts[:8] + ([f"... and {len(conflicts) - 8} more"] if len(conflicts) > 8 else [])
            raise CheckpointError(
                f"Refusing to save {path}: two ranks would write different values under one key, and the checkpoint"
                " would keep either:\n  " + "\n  ".join(shown) + "\nEvery entry must have one owner or agree"
                " on every rank that holds it: a buffer set per rank, or one each data-parallel replica updates from"
                " its own data (BatchNorm running statistics: synchronize it over the replicas first), must not be"
                " persistent (`register_buffer(..., persistent=False)`) or must be made equal before the save."
            )
        if is_rank_zero:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            staging.mkdir(parents=True)
            torch.save(meta, staging / META_FILENAME)
        barrier()
        writer = _Writer(str(staging))
        if not self.asynchronous:
            dcp.save(flat, storage_writer=writer)
            if is_rank_zero:
                _commit(staging, path)
            barrier()
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        response = dcp.async_save(flat, storage_writer=writer, process_group=self._group)
        self._pending = getattr(response, "upload_completion", response)
        self._staging, self._is_rank_zero = staging, is_rank_zero
        if is_rank_zero:
            pending = self._pending

            def commit_when_written() -> None:
                try:
                    pending.result()
                    _commit(staging, path)
                    self._remove_deferred()
                except BaseException as error:  # surfaced by wait()
                    self._commit_error.append(error)

            # not a daemon: a save started after training (trainer.save_checkpoint after fit) is still committed
            # before the interpreter exits, as DCP's own writer thread is waited for
            self._commit_thread = threading.Thread(target=commit_when_written)
            self._commit_thread.start()

    def remove(self, path: Path) -> None:
        """Delete a checkpoint directory (rank 0), but only after a pending background save is committed: so that
        ``ModelCheckpoint(save_top_k=...)`` removing the older checkpoint never leaves none complete on disk.

        Example:
            >>> # strategy.remove_checkpoint(path) -> if self.is_global_zero: writer.remove(Path(path))
        """
        self._removals.append(Path(path))
        if self._pending is None:
            self._remove_deferred()

    def _remove_deferred(self) -> None:
        while self._removals:
            shutil.rmtree(self._removals.pop(0), ignore_errors=True)

    def wait(self) -> None:
        """Block until the previous asynchronous save is written and committed (no-op when none is pending)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        finally:
            if self._commit_thread is not None:  # it ends once the write has (whether it failed or not)
                self._commit_thread.join()
                self._commit_thread = None
        if self._commit_error:
            error = self._commit_error.pop()
            raise CheckpointError(f"an asynchronous checkpoint save failed: {error}") from error
        self._remove_deferred()  # any asked for after the commit thread's own pass
        if not self._is_rank_zero and self._staging is not None:
            # rank 0 renames the staging directory once every rank has written: wait until the file system shows it,
            # so that code on this rank may open the checkpoint right away (no collective: wait() also runs on
            # teardown after an error, when other ranks may not arrive)
            deadline = time.monotonic() + _COMMIT_WAIT_S
            while self._staging.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._staging.exists():
                raise CheckpointError(f"rank 0 did not commit {self._staging} within {_COMMIT_WAIT_S} s.")

    def close(self) -> None:
        """Wait for a pending save, then destroy the process group of the background saves (a later save makes a
        new one): a gloo group left alive until the interpreter exits can abort the process there. Not collective."""
        try:
            self.wait()
        finally:
            if self._group is not None:
                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank (one small collective, reached by all ranks before DCP's)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    merged: list[str] = []
    for rank_problems in gathered:
        merged += [p for p in rank_problems if p not in merged]
    return merged


def _raise(path: Path, problems: list[str]) -> None:
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    raise CheckpointError(f"Cannot load checkpoint {path}:\n  " + "\n  ".join(shown))


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    zeros: list[Optional[ShardedOptimizer]],
    *,
    aliases: Optional[dict[str, str]] = None,
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load a checkpoint directory in place into ``module`` and ``optimizers``, whatever layout it was saved in.

    Collective: every rank calls it. Returns the rest of Lightning's checkpoint (from ``meta.pt``). Raises
    :class:`CheckpointError` on every rank for a missing or truncated shard file, a missing key or a shape mismatch.

    Example:
        >>> # meta = load_sharded(Path("last.ckpt"), module, optimizers, [strategy._sharded_for(o) for o in optimizers])
    """
    import torch.distributed.checkpoint as dcp

    problems = check_files(path)
    if problems:
        _raise(path, problems)
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    problems = check_shard_files(path, metadata)
    if problems:
        _raise(path, problems)
    meta = read_meta(path, weights_only=weights_only)
    available = set(metadata.state_dict_metadata)
    aliases = aliases or {}
    targets: dict[str, Any] = {}
    describe: dict[str, str] = {}
    for name, value in module.state_dict().items():
        key = f"state_dict.{name}"
        if key not in available and not strict:
            continue
        targets[key] = value
        describe[key] = f"`{name}`"
    missing: list[str] = []
    finishers = []
    for index, (optimizer, zero) in enumerate(zip(optimizers, zeros)):
        got, words, lacking, finish = optimizer_load_targets(
            module, optimizer, zero, f"optimizer_{index}", available, aliases
        )
        targets.update(got)
        describe.update(words)
        missing += lacking
        finishers.append(finish)
    hyperparameters = meta.get(OPTIMIZER_HYPERPARAMETERS_KEY, [])
    plan = plan_load(targets, metadata, describe)
    problems = [*plan.errors, *(f"{m}: not in the checkpoint" for m in missing)]
    if len(hyperparameters) < len(optimizers):
        problems.append(f"it holds {len(hyperparameters)} optimizer(s), the module configures {len(optimizers)}")
    problems = _agree(problems)
    if problems:
        _raise(path, problems)
    dcp.load(plan.request, storage_reader=SafeFileSystemReader(str(path)))
    plan.finish()
    for finish, saved in zip(finishers, hyperparameters):
        finish(plan.request, saved)
    hybrid_keys = (LAYOUT_KEY, VERSIONS_KEY, OPTIMIZER_HYPERPARAMETERS_KEY, HUGGING_FACE_KEY)
    return {k: v for k, v in meta.items() if k not in hybrid_keys}
