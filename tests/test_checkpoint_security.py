"""Loading a checkpoint runs no code stored in it: hostile ``meta.pt`` and DCP ``.metadata`` files are refused.

Single process: the readers are what every rank calls before any collective (``load_sharded``, ``consolidate``).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_hybrid.checkpoint import META_FILENAME, CheckpointError, consolidate, read_meta
from lightning_hybrid.checkpoint.format import SafeFileSystemReader


class _CreatesFile:
    """Unpickling this calls ``os.mkdir(target)``: a stand-in for any code a pickle can run while it loads."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def _checkpoint(root: Path) -> Path:
    path = root / "step=1.ckpt"
    dcp.save({"state_dict.w": torch.randn(3, 4)}, checkpoint_id=str(path), no_dist=True)
    meta = {
        "global_step": 1,
        "hyper_parameters": {"lr": 0.1},
        "callbacks": {"x": {"best": torch.tensor(1.0)}},
    }
    torch.save(meta, path / META_FILENAME)
    return path


def test_a_plain_checkpoint_reads_with_the_restricted_readers(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    meta = read_meta(path)
    assert meta["global_step"] == 1 and meta["hyper_parameters"]["lr"] == 0.1
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    assert "state_dict.w" in metadata.state_dict_metadata


def test_meta_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    target = tmp_path / "pwned"
    torch.save({"global_step": 1, "payload": _CreatesFile(target)}, path / META_FILENAME)
    with pytest.raises(CheckpointError, match=r"meta.pt holds objects .*weights_only=False"):
        read_meta(path)
    with pytest.raises(CheckpointError, match="only a full unpickle"):  # verify=False: past the hash check
        consolidate(path, tmp_path / "out", verify=False)
    assert not target.exists(), "loading ran the code stored in meta.pt"
    read_meta(path, weights_only=False)  # the payload is live: a full unpickle (trusted checkpoints only) runs it
    assert target.exists()


def test_dcp_index_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    target = tmp_path / "pwned"
    with open(path / ".metadata", "wb") as f:
        pickle.dump(_CreatesFile(target), f)
    with pytest.raises(CheckpointError, match=r"index .metadata is not a plain DCP index .*posix.mkdir"):
        SafeFileSystemReader(str(path)).read_metadata()
    with pytest.raises(CheckpointError, match="not a plain DCP index"):  # verify=False: past the hash check
        consolidate(path, tmp_path / "out", verify=False)
    assert not target.exists(), "loading ran the code stored in .metadata"
    with pytest.raises(AttributeError):  # torch's own reader unpickles it, runs the payload, then finds no index
        FileSystemReader(str(path)).read_metadata()
    assert target.exists()
