"""Checkpoint integrity and full disks, in one process: the commit record's hashes, damaged files refused with the
file named (load checks, ``lightning-hybrid consolidate``), ``ckpt_path="last"`` going past invalid checkpoints, and
an ``OSError(ENOSPC)`` at each point of a save (synchronous and asynchronous) committing nothing.

The same on two ranks (every rank refuses, every rank learns of another rank's full disk, the resumed run continues
exactly) is in ``tests/test_checkpoint.py``'s safety group.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from lightning_hybrid.checkpoint import (
    COMMIT_FILENAME,
    CheckpointError,
    ShardedCheckpointWriter,
    checked_files,
    checkpoint_to_load,
    consolidate,
    read_meta,
)
from tests.checkpoint_faults import POINTS, disk_full, flip_byte

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def _save(directory: Path, name: str, step: int, writer: Optional[ShardedCheckpointWriter] = None) -> Path:
    """A checkpoint as HybridStrategy writes it (one rank): a 256 KiB weight, so the middle of a shard is data."""
    torch.manual_seed(step)
    path = directory / name
    directory.mkdir(parents=True, exist_ok=True)
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    (writer or ShardedCheckpointWriter()).save(path, state, [], {"global_step": step}, is_rank_zero=True)
    return path


def _trainer(*directories: Path) -> Any:
    """What ``checkpoint_to_load`` reads of a Trainer: its ModelCheckpoint callbacks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=str(d)) for d in directories])


def test_a_save_records_every_file_with_its_sha256(tmp_path: Path) -> None:
    path = _save(tmp_path, "step=1.ckpt", 1)
    record = json.loads((path / COMMIT_FILENAME).read_text())
    assert record["algorithm"] == "sha256"
    assert sorted(record["files"]) == sorted(p.name for p in path.iterdir() if p.name != COMMIT_FILENAME)
    assert {".metadata", "meta.pt", "__0_0.distcp", "README.txt"} <= record["files"].keys()
    # Lightning's own load_from_checkpoint stops on the directory before our code runs: the folder says how to load it
    readme = (path / "README.txt").read_text()
    assert "IsADirectoryError" in readme and "lightning_hybrid.load_from_checkpoint(MyModule, path)" in readme
    for name, (size, digest) in record["files"].items():
        data = (path / name).read_bytes()
        assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest()), name
    assert checked_files(path) == []


DAMAGE = {
    "flipped-shard": ("__0_0.distcp", r"file __0_0\.distcp is corrupt: its sha256 is [0-9a-f]{16}\.\.\., [0-9a-f]{16}"),
    "truncated-shard": ("__0_0.distcp", r"file __0_0\.distcp is truncated: \d+ bytes, \d+ when saved"),
    "flipped-index": (".metadata", r"file \.metadata is corrupt"),
    "flipped-meta": ("meta.pt", r"file meta\.pt is corrupt"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_refused_with_the_file_named(tmp_path: Path, damage: str) -> None:
    """A flipped byte in the middle of a file or a truncated file: the load check and ``consolidate`` refuse it,
    naming the file. ``verify=False`` skips the hashing (the flipped byte passes) but still checks sizes."""
    path = _save(tmp_path, "step=1.ckpt", 1)
    name, expected = DAMAGE[damage]
    file = path / name
    if damage.startswith("truncated"):
        os.truncate(file, file.stat().st_size - 1)
    else:
        flip_byte(file)
    problems = checked_files(path)
    assert len(problems) == 1 and re.fullmatch(expected + ".*", problems[0]), problems
    with pytest.raises(CheckpointError, match=rf"Cannot consolidate {re.escape(str(path))}:\n  {expected}"):
        consolidate(path, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert checked_files(path, verify=False) == ([] if damage.startswith("flipped") else problems)


def test_consolidate_command_refuses_a_corrupt_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``lightning-hybrid consolidate`` on a shard with one flipped byte: exit status 1 and a message naming the file
    (no traceback), nothing written; ``--no-verify`` (no hashing) writes the weights, flipped byte included."""
    from lightning_hybrid.cli import main

    path = _save(tmp_path, "step=1.ckpt", 1)
    flip_byte(path / "__0_0.distcp")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["consolidate", str(path), str(out)])
    err = capsys.readouterr().err
    assert exited.value.code == 1
    assert f"Cannot consolidate {path}:" in err and "file __0_0.distcp is corrupt" in err, err
    assert "Traceback" not in err and not (out / "model.safetensors").exists()
    assert main(["consolidate", str(path), str(out), "--no-verify"]) == 0
    assert (out / "model.safetensors").is_file()


def _checkpoints(directory: Path) -> dict[str, Path]:
    """step=2, step=4 and last (step 4) in one ModelCheckpoint directory, modified in that order."""
    paths = {
        "step2": _save(directory, "epoch=0-step=2.ckpt", 2),
        "step4": _save(directory, "epoch=0-step=4.ckpt", 4),
        "last": _save(directory, "last.ckpt", 4),
    }
    for seconds, path in enumerate(paths.values(), start=1):
        os.utime(path, (1000.0 * seconds, 1000.0 * seconds))
    return paths


def test_last_loads_a_valid_last_checkpoint_unchanged(tmp_path: Path) -> None:
    paths = _checkpoints(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped: no warning
        assert checkpoint_to_load(paths["last"], _trainer(tmp_path)) == (paths["last"], True)


def test_last_goes_past_invalid_checkpoints_and_says_which_and_why(tmp_path: Path) -> None:
    """``last.ckpt`` has a flipped byte and the newest other checkpoint a truncated shard: ``ckpt_path="last"``
    loads the newest valid one in that directory, step 2 (not the newer one another callback's directory holds),
    and the warning names both skipped ones with their reasons."""
    paths = _checkpoints(tmp_path / "run")
    _save(tmp_path / "other", "epoch=0-step=9.ckpt", 9)  # newest of all, but another callback's
    flip_byte(paths["last"] / "__0_0.distcp")
    shard = paths["step4"] / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.warns(UserWarning) as caught:
        chosen, verified = checkpoint_to_load(paths["last"], _trainer(tmp_path / "other", tmp_path / "run"))
    assert (chosen, verified) == (paths["step2"], True)
    (message,) = [str(w.message) for w in caught if "ckpt_path" in str(w.message)]
    assert re.search(rf'^ckpt_path="last": skipped {re.escape(str(paths["last"]))} \(file __0_0\.distcp is corrupt',
                     message), message  # fmt: skip
    assert f"skipped {paths['step4']} (file __0_0.distcp is truncated" in message, message
    assert message.endswith(f"Resuming from {paths['step2']}, the newest checkpoint that passes its integrity check.")


def test_last_never_picks_a_half_written_directory(tmp_path: Path) -> None:
    """A ``last.ckpt`` directory without a commit record (a copy in progress, a save that never committed) is skipped
    for the previous checkpoint; a checkpoint named explicitly is not replaced (its load refuses it instead)."""
    paths = _checkpoints(tmp_path)
    (paths["last"] / COMMIT_FILENAME).unlink()
    with pytest.warns(UserWarning, match=r"skipped .*last\.ckpt \(it has no commit record \(commit\.json\)"):
        assert checkpoint_to_load(paths["last"], _trainer(tmp_path)) == (paths["step4"], True)
    flip_byte(paths["step4"] / "__0_0.distcp")
    assert checkpoint_to_load(paths["step4"], _trainer(tmp_path)) == (paths["step4"], False)
    assert checkpoint_to_load(paths["last"], _trainer(tmp_path), verify=False) == (paths["last"], False)
    flip_byte(paths["step2"] / "meta.pt")
    with pytest.raises(CheckpointError, match=r'ckpt_path="last": no checkpoint passes its integrity check:\n'):
        checkpoint_to_load(paths["last"], _trainer(tmp_path))


@pytest.mark.parametrize("point", POINTS)
def test_a_full_disk_at_any_point_of_a_save_commits_nothing(tmp_path: Path, point: str) -> None:
    """An ``OSError(ENOSPC)`` while saving over ``last.ckpt``: a clear error, ``last.ckpt`` is the previous checkpoint,
    whole and picked by ``ckpt_path="last"``, no partial directory is left, and the next save (space again) commits."""
    last = _save(tmp_path, "last.ckpt", 1)
    record = (last / COMMIT_FILENAME).read_text()
    writer = ShardedCheckpointWriter()
    full = rf"Saving checkpoint {re.escape(str(last))} failed \(the disk is full\):\n  rank 0: OSError: \[Errno 28\] "
    with disk_full(point), pytest.raises(CheckpointError, match=full + r".*\nNothing was committed: last\.ckpt is"):
        _save(tmp_path, "last.ckpt", 2, writer)
    assert (last / COMMIT_FILENAME).read_text() == record and read_meta(last)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert checkpoint_to_load(last, _trainer(tmp_path)) == (last, True)
    _save(tmp_path, "last.ckpt", 2, writer)
    assert read_meta(last)["global_step"] == 2 and checked_files(last) == []


@pytest.fixture
def one_process_group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("point", ["shard", "commit.json"])
def test_an_asynchronous_save_hashes_and_reports_a_full_disk(tmp_path: Path, one_process_group: Any,
                                                             point: str) -> None:  # fmt: skip
    """Background saves write the commit record too; one that meets a full disk raises from ``wait`` (the next save
    or the end of training) and leaves the previous checkpoint in place."""
    writer = ShardedCheckpointWriter(asynchronous=True)
    try:
        last = _save(tmp_path, "last.ckpt", 1, writer)
        writer.wait()
        assert checked_files(last) == []
        with disk_full(point):
            _save(tmp_path, "last.ckpt", 2, writer)
            with pytest.raises(CheckpointError, match=r"failed \(the disk is full\):\n  rank 0: OSError: \[Errno 28"):
                writer.wait()
        assert read_meta(last)["global_step"] == 1 and checked_files(last) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    finally:
        writer.close()
