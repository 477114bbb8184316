"""Saving and loading checkpoint directories: every rank writes its own shards, and a save becomes visible at once.

A save is one run of DCP's protocol, so that a failure at any point of it (a full disk included) reaches every rank
through DCP's own outcome sharing: each step's errors are gathered on the coordinator (rank 0) and sent back to
every rank, which raises. Rank 0 clears the hidden staging directory next to the target (``.NAME.partial``) and
writes ``meta.pt`` once every rank has planned (no rank writes before that); every rank writes its shards into it and
hashes them; rank 0, once every rank's write succeeded, writes DCP's ``.metadata`` and the commit record
(:mod:`.integrity`) and renames the staging directory to ``NAME``. A crash or kill during a save leaves the staging
directory behind and the previous ``NAME`` untouched; a failed save removes it. Lightning's ``ckpt_path="last"`` and
``ModelCheckpoint`` only look at ``*.ckpt`` names, so they never see a partial save.

A load first checks what can be checked without reading tensors (the files exist with their recorded sizes and, unless
``verify=False``, hashes: each rank hashes its share of the files; every key this rank needs is in the index with a
compatible shape), and agrees on the outcome over all ranks before DCP's collectives start, so a bad checkpoint raises
the same error everywhere.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.optim import Optimizer

from lightning_hybrid.checkpoint.consolidate import natural_shape_entries
from lightning_hybrid.checkpoint.format import (  # noqa: F401  (LAYOUT_KEY, VERSIONS_KEY: re-exported from here)
    LAYOUT_KEY,
    META_FILENAME,
    METADATA_FILENAME,
    OPTIMIZER_HYPERPARAMETERS_KEY,
    VERSIONS_KEY,
    CheckpointError,
    SafeFileSystemReader,
    lightning_entries,
    read_index,
    read_meta,
    staging_path,
)
from lightning_hybrid.checkpoint.integrity import (
    NO_VERIFY_HINT,
    bytes_digest,
    checkpoint_problems,
    file_digest,
    hashed,
    write_commit_record,
    write_file,
)
from lightning_hybrid.checkpoint.optimizer import HYPERPARAMETERS_KEY, optimizer_load_targets
from lightning_hybrid.checkpoint.tensors import conflicting_entries, dcp_ready, plan_load

if TYPE_CHECKING:
    from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

__all__ = [
    "LAYOUT_KEY",
    "META_FILENAME",
    "CheckpointError",
    "ShardedCheckpointWriter",
    "checked_files",
    "checkpoint_to_load",
    "flatten_state",
    "load_sharded",
    "read_meta",
]

# test-only: "RANK:N" makes that rank SIGKILL itself in the middle of its N-th save (after writing its shards, before
# the save is committed), to test that a killed save leaves the previous checkpoint intact
KILL_IN_SAVE_ENV = "LIGHTNING_HYBRID_TEST_KILL_IN_SAVE"
_saves_started = 0


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


README_FILENAME = "README.txt"
LOADING_README = """\
A lightning-hybrid checkpoint: each rank's shards of the model, optimizer and loops, saved with
torch.distributed.checkpoint. It is a directory, so Lightning's `MyModule.load_from_checkpoint(path)`
(which reads one file) stops on it with IsADirectoryError. To load it:

  resume training, in any layout:  trainer.fit(model, ckpt_path=path)   (strategy=HybridStrategy(...))
  into a plain module, one process: lightning_hybrid.load_from_checkpoint(MyModule, path)
                                    or put lightning_hybrid.ShardedCheckpointMixin in MyModule's bases
  as one Lightning .ckpt file:      lightning-hybrid consolidate path out.ckpt
  as safetensors (Hugging Face):    lightning-hybrid consolidate path out_dir

commit.json lists every file with its size and SHA-256 (`sha256sum` checks one by hand).
"""


class _Writer(FileSystemWriter):
    """DCP's file-system writer that also prepares the staging directory, hashes what it writes and commits.

    Each step runs where DCP shares its errors with every rank: ``prepare_global_plan`` and ``finish`` on the
    coordinator, ``write_data`` on every rank.
    """

    def __init__(self, staging: Path, target: Path, meta: Optional[bytes]) -> None:
        super().__init__(str(staging))
        self._staging, self._target, self._meta = staging, target, meta

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        # every rank has planned and none has written yet: clear what a killed save left, then write meta.pt
        assert self._meta is not None, "DCP's coordinator must be global rank 0, which holds meta.pt"
        shutil.rmtree(self._staging, ignore_errors=True)
        self._staging.mkdir(parents=True)
        write_file(self._staging / META_FILENAME, self._meta)
        # Lightning's `MyModule.load_from_checkpoint(directory)` stops at the directory with the OS's bare
        # IsADirectoryError, before any code of ours runs: what a user then opens says how to load it
        write_file(self._staging / README_FILENAME, LOADING_README.encode())
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            future = super().write_data(plan, planner)
        except Exception as error:
            raise _os_error_in(error) from error
        kill = os.environ.get(KILL_IN_SAVE_ENV)
        if kill:
            rank, count = (int(x) for x in kill.split(":"))
            if dist.get_rank() == rank and _saves_started == count:
                future.wait()  # this rank's shards are written; the save is not committed
                os.kill(os.getpid(), signal.SIGKILL)
        # the hashes travel to the coordinator with the write results (DCP gathers them for `finish`)
        return future.then(lambda written: hashed(written.value(), self._staging))

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        super().finish(metadata, results)  # writes .metadata
        files: dict[str, list[Any]] = {}
        for rank_results in results:
            files.update(getattr(rank_results, "digests", {}))
        # the files from the write results themselves: torch 2.11's `finish` fills a copy of `metadata`, not it
        written = {result.storage_data.relative_path for rank_results in results for result in rank_results}
        unhashed = written - files.keys()
        if unhashed:  # a writer path that bypassed write_data: refuse to commit what cannot be verified
            raise CheckpointError(f"no hash was reported for {sorted(unhashed)}")
        files[METADATA_FILENAME] = list(file_digest(self._staging / METADATA_FILENAME))
        files[META_FILENAME] = bytes_digest(self._meta or b"")
        files[README_FILENAME] = bytes_digest(LOADING_README.encode())
        write_commit_record(self._staging, files)
        _commit(self._staging, self._target)


def _os_error_in(error: BaseException) -> BaseException:
    """The ``OSError`` behind ``error``, if any. A full disk inside ``torch.save``'s zip writer (DCP's tensor files)
    surfaces as its "unexpected pos" error raised while closing the archive, with the ``OSError`` only as its
    ``__context__``, which DCP's gathering of errors (a pickle) does not carry to the other ranks."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return error


def _commit(staging: Path, path: Path) -> None:
    """Rank 0, once every rank's part is written: make the staging directory the checkpoint."""
    replaced = _replaced_path(path)
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)  # kept until the new one is in place: a crash here leaves it recoverable
    try:
        os.replace(staging, path)
    except BaseException:
        if replaced.exists() and not path.exists():
            os.replace(replaced, path)  # the rename failed (a full directory, say): the previous one stays
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _save_failed(path: Path, error: CheckpointException) -> CheckpointError:
    """One message for every rank: which ranks failed and how (DCP sends every rank all failures)."""
    import errno

    lines = [f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(error.failures.items())]
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e, _ in error.failures.values())
    return CheckpointError(
        f"Saving checkpoint {path} failed"
        + (" (the disk is full)" if full else "")
        + ":\n  "
        + "\n  ".join(lines)
        + f"\nNothing was committed: {path.name} is unchanged (the previous checkpoint under this name, if any, is"
        " still the newest valid one) and the partial save was removed."
        + (" Free space on the checkpoint file system (or save elsewhere), then save again." if full else "")
    )


class ShardedCheckpointWriter:
    """Writes checkpoint directories, synchronously or in the background (``asynchronous=True``).

    An asynchronous save copies this rank's shards to CPU memory (``dcp.async_save``'s staging), returns, and writes
    them in a background thread over a process group of its own (a second thread's collectives must not interleave
    with training's on the same group). The commit happens inside the save, when every rank has written; the next save
    and :meth:`wait` (called at the end of training) wait for it, and raise on every rank if it failed.

    Example:
        >>> writer = ShardedCheckpointWriter(asynchronous=False)
        >>> # writer.save(Path("step=10.ckpt"), model_state, optimizer_states, meta, is_rank_zero=rank == 0)
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._pending: Optional[Any] = None
        self._target: Optional[Path] = None
        self._removal_thread: Optional[threading.Thread] = None
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
    ) -> None:
        """Every rank writes its shards of ``model_state``/``optimizer_states``; rank 0 writes ``meta``. Collective.

        Raises :class:`CheckpointError` on every rank if any rank fails (a full disk, say) at any point of the write;
        nothing is committed then. An asynchronous save raises so from the next save or :meth:`wait`.
        """
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
        serialized = None
        if is_rank_zero:  # now: an asynchronous save must keep the values of this moment
            buffer = io.BytesIO()
            torch.save(meta, buffer)
            serialized = buffer.getvalue()
        writer = _Writer(staging, path, serialized)
        if not self.asynchronous:
            try:
                dcp.save(flat, storage_writer=writer)
            except CheckpointException as error:  # every rank gets it; all ranks are past writing
                if is_rank_zero:
                    shutil.rmtree(staging, ignore_errors=True)
                raise _save_failed(path, error) from error
            self._remove_deferred()
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        response = dcp.async_save(flat, storage_writer=writer, process_group=self._group)
        self._pending = getattr(response, "upload_completion", response)
        self._target = path
        if is_rank_zero:
            pending = self._pending

            def after_write() -> None:
                try:
                    pending.result()
                except BaseException:  # raised on every rank by wait()
                    shutil.rmtree(staging, ignore_errors=True)
                    return
                self._remove_deferred()

            # not a daemon: deletions asked for during a save started after training (trainer.save_checkpoint after
            # fit) still happen before the interpreter exits, as DCP's own writer thread is waited for
            self._removal_thread = threading.Thread(target=after_write)
            self._removal_thread.start()

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
        """Block until the previous asynchronous save is written and committed (no-op when none is pending); raise
        :class:`CheckpointError` if it failed (on every rank: DCP shares the outcome). Not collective."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except CheckpointException as error:
            assert self._target is not None
            self._removals.clear()  # the older checkpoints stay: the newer one was not committed
            raise _save_failed(self._target, error) from error
        finally:
            if self._removal_thread is not None:  # it ends once the write has (whether it failed or not)
                self._removal_thread.join()
                self._removal_thread = None
        self._remove_deferred()  # any asked for after the thread's own pass

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


def checked_files(path: Path, *, verify: bool = True) -> list[str]:
    """What is wrong with the files of checkpoint ``path`` (missing, a size or, with ``verify``, a hash that differs
    from its commit record), agreed over all ranks: collective. Each rank hashes its share of the files.

    Example:
        >>> # checked_files(Path("last.ckpt"))  # [] or ["file __0_0.distcp is corrupt: ..."]
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return _agree(checkpoint_problems(path, verify=verify, rank=rank, world=world))


def _last_candidates(path: Path, trainer: Any) -> list[str]:
    """``path`` followed by every other checkpoint directory next to it, newest first, if ``path`` is one that
    ``ckpt_path="last"`` picks (a ``last*.ckpt`` of one of the Trainer's ``ModelCheckpoint`` callbacks); else nothing.

    Only ``path``'s own directory: the callback that wrote it wrote those (another callback's directory, such as
    Lightning's default ``checkpoints/``, may hold another run's checkpoints)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [c for c in getattr(trainer, "checkpoint_callbacks", []) if isinstance(c, ModelCheckpoint)]
    # Lightning's rule for ckpt_path="last" (ModelCheckpoint._find_last_checkpoints): a name starting with
    # CHECKPOINT_NAME_LAST, with FILE_EXTENSION, in the callback's directory
    owner = next(
        (
            c
            for c in callbacks
            if c.dirpath
            and Path(c.dirpath).resolve() == path.parent.resolve()
            and path.suffix == c.FILE_EXTENSION
            and path.stem.startswith(c.CHECKPOINT_NAME_LAST or "last")
        ),
        None,
    )
    if owner is None:
        return []
    others = [p for p in path.parent.iterdir() if p.suffix == owner.FILE_EXTENSION and p.is_dir() and p != path]
    # newest first, by modification time, as Lightning orders its "last" candidates (a save's directory is last
    # modified when its commit record is written)
    others.sort(key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    return [str(path), *map(str, others)]


def checkpoint_to_load(path: Path, trainer: Any, *, verify: bool = True) -> tuple[Path, bool]:
    """The checkpoint to load for ``trainer.fit(ckpt_path=...)`` once Lightning resolved it to ``path``, and whether
    its files were verified here. Collective.

    ``path`` itself, unless it is the checkpoint ``ckpt_path="last"`` picks (a ``last*.ckpt`` of the Trainer's
    ``ModelCheckpoint``) and fails its integrity check: then the newest checkpoint in its directory that passes, with
    a warning naming each one skipped and why. ``verify=False`` returns ``path`` unchecked.

    Example:
        >>> # path, verified = checkpoint_to_load(Path("checkpoints/last.ckpt"), trainer)
    """
    if not verify:
        return path, False
    candidates: list[Any] = [_last_candidates(path, trainer) if not dist.is_initialized() or dist.get_rank() == 0
                             else None]  # fmt: skip
    if dist.is_initialized():  # rank 0's view of the directory, so that every rank walks the same list
        dist.broadcast_object_list(candidates, src=0)
    if not candidates[0]:
        return path, False
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    skipped: list[str] = []
    for candidate in map(Path, candidates[0]):
        problems = checked_files(candidate, verify=True)
        if not problems:
            if skipped:
                rank_zero_warn(
                    'ckpt_path="last": skipped '
                    + "; skipped ".join(skipped)
                    + f". Resuming from {candidate}, the newest checkpoint that passes its integrity check."
                )
            return candidate, True
        skipped.append(f"{candidate} ({problems[0]}{f' and {len(problems) - 1} more' if len(problems) > 1 else ''})")
    raise CheckpointError(
        'ckpt_path="last": no checkpoint passes its integrity check:\n  ' + "\n  ".join(skipped) + "\nRestore one"
        f" from a copy, or pass ckpt_path=None to start afresh; {NO_VERIFY_HINT} loads one unchecked."
    )


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    zeros: list[Optional[ShardedOptimizer]],
    *,
    aliases: Optional[dict[str, str]] = None,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint directory in place into ``module`` and ``optimizers``, whatever layout it was saved in.

    Collective: every rank calls it. Returns the rest of Lightning's checkpoint (from ``meta.pt``). Raises
    :class:`CheckpointError` on every rank for a missing, truncated or (unless ``verify=False``, which skips the
    hashing) corrupt file, a missing key or a shape mismatch.

    Example:
        >>> # meta = load_sharded(Path("last.ckpt"), module, optimizers, [strategy._sharded_for(o) for o in optimizers])
    """
    import torch.distributed.checkpoint as dcp

    problems = checked_files(path, verify=verify)  # before anything in them is unpickled
    if problems:
        _raise(path, problems)
    metadata, problems = read_index(path)
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
    return lightning_entries(meta)
