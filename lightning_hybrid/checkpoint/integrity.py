"""Checkpoint integrity: each file's size and content hash, in a commit record that a save writes last.

A save commits on DCP's coordinator (rank 0) once every rank has written its shards and reported their hashes: it
writes DCP's index ``.metadata``, then the commit record ``commit.json`` (every file of the checkpoint with its size
and SHA-256), then renames the staging directory to the checkpoint's name. A checkpoint is valid when its commit
record exists and every file it lists has that size and that hash; a load checks this before reading any tensor.

SHA-256 rather than BLAKE2b: ``hashlib``'s SHA-256 is OpenSSL's, which uses the CPU's SHA instructions (x86 SHA-NI,
Armv8 SHA-2), about 2-3x the speed of ``hashlib``'s BLAKE2b there; and ``sha256sum`` checks a file by hand.

Each rank hashes the files it wrote right after writing them, reading them back: that hashes exactly the bytes in the
file, however DCP's writer produced them (threads, stream extensions, offsets), for one extra read from the page
cache, which costs a fraction of the hashing itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from lightning_hybrid.checkpoint.format import CheckpointError, check_files

__all__ = [
    "ALGORITHM",
    "COMMIT_FILENAME",
    "HashedWriteResults",
    "checkpoint_problems",
    "file_digest",
    "integrity_problems",
]

COMMIT_FILENAME = "commit.json"
ALGORITHM = "sha256"
_FORMAT = 1
_CHUNK = 4 * 2**20  # read buffer: large enough that hashlib (which releases the GIL) dominates, small in memory

# `verify=False` for a checkpoint that has no commit record, named in the errors
NO_VERIFY_HINT = "`HybridStrategy(checkpoint_verify=False)` (or `lightning-hybrid consolidate --no-verify`)"


def file_digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex digest)`` of a file, read in chunks (``hashlib.file_digest`` needs Python 3.11).

    Example:
        >>> # file_digest(Path("last.ckpt/__0_0.distcp"))  # (25812345, "9f86d0...")
    """
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as stream:
        while count := stream.readinto(buffer):
            digest.update(view[:count])
            size += count
    return size, digest.hexdigest()


def bytes_digest(data: bytes) -> list[Any]:
    """The commit record's entry for a file holding ``data``: ``[size, hex digest]``."""
    return [len(data), hashlib.new(ALGORITHM, data).hexdigest()]


class HashedWriteResults(list):
    """One rank's DCP write results (a list of ``WriteResult``, as DCP expects) that also carry ``digests``:
    ``{file name: [size, hex digest]}`` of the files this rank wrote. DCP gathers every rank's write results on its
    coordinator and hands them to the storage writer's ``finish``, which writes the commit record from them."""

    digests: dict[str, list[Any]]


def hashed(results: list[Any], directory: Path) -> HashedWriteResults:
    """``results`` (this rank's ``WriteResult``s) with the digests of the files they were written to."""
    out = HashedWriteResults(results)
    names = sorted({result.storage_data.relative_path for result in results})
    out.digests = {name: list(file_digest(directory / name)) for name in names}
    return out


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` and flush it to the device (as DCP does with its own files), so a committed checkpoint's files
    survive a power loss."""
    with path.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def write_commit_record(directory: Path, files: dict[str, list[Any]]) -> None:
    """Write ``directory/commit.json``: every file of the checkpoint with its size and hash (the last file a save
    writes; JSON, so reading it runs no code)."""
    record = {"format": _FORMAT, "algorithm": ALGORITHM, "files": {k: files[k] for k in sorted(files)}}
    write_file(directory / COMMIT_FILENAME, json.dumps(record, indent=1).encode())


def read_commit_record(path: Path) -> Optional[dict[str, list[Any]]]:
    """The files a checkpoint's commit record lists, ``{name: [size, hex digest]}``; None when it has none. Raises
    :class:`CheckpointError` for a record that does not parse."""
    file = Path(path) / COMMIT_FILENAME
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown algorithm {record.get('algorithm')!r}")
        return {str(k): [int(v[0]), str(v[1])] for k, v in files.items()}
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise CheckpointError(f"its commit record {COMMIT_FILENAME} is damaged ({error})") from None


def assigned_files(files: dict[str, list[Any]], rank: int, world: int) -> list[str]:
    """The files ``rank`` hashes when ``world`` ranks check a checkpoint together: the largest first, each to the
    least-loaded rank so far, so every byte is read once and the ranks finish about together (identical everywhere)."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n][0], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += files[name][0]
        if owner == rank:
            mine.append(name)
    return mine


def integrity_problems(path: Path, *, verify: bool = True, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint directory ``path`` against its commit record, as this rank sees it.

    Every rank checks that each listed file exists with its recorded size (the same result everywhere); with
    ``verify``, rank ``rank`` of ``world`` also hashes its share of the files (:func:`assigned_files`), so the ranks
    must share their problems before acting on them. ``verify=False`` accepts a checkpoint without a commit record.

    Example:
        >>> # integrity_problems(Path("last.ckpt"))  # [] or ["file __0_0.distcp is corrupt: ..."]
    """
    try:
        files = read_commit_record(path)
    except CheckpointError as error:
        return [str(error)]
    if files is None:
        if not verify:
            return []
        return [
            f"it has no commit record ({COMMIT_FILENAME}): the save did not finish, or an older lightning-hybrid"
            f" wrote it without one; {NO_VERIFY_HINT} loads it unchecked."
        ]
    problems = []
    for name, (size, _) in sorted(files.items()):
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"file {name} is missing (its commit record lists it)")
        elif file.stat().st_size != size:
            problems.append(
                f"file {name} is {'truncated' if file.stat().st_size < size else 'longer than saved'}:"
                f" {file.stat().st_size} bytes, {size} when saved"
            )
    if problems or not verify:
        return problems
    for name in assigned_files(files, rank, world):
        _, digest = file_digest(Path(path) / name)
        if digest != files[name][1]:
            problems.append(
                f"file {name} is corrupt: its {ALGORITHM} is {digest[:16]}..., {files[name][1][:16]}... when saved"
                " (its content changed after the save: a disk, copy or transfer error)"
            )
    return problems


def checkpoint_problems(path: Path, *, verify: bool = True, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint directory ``path`` before anything in it is unpickled, as this rank sees it: the
    directory and its index files (``format.check_files``), then every file against the commit record
    (:func:`integrity_problems`: rank ``rank`` of ``world`` hashes its share, so ranks share the problems found).

    Example:
        >>> # checkpoint_problems(Path("last.ckpt"))  # [] or ["... .metadata missing (the save did not finish)."]
    """
    return check_files(path) or integrity_problems(path, verify=verify, rank=rank, world=world)
