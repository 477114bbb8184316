"""Reading a checkpoint directory's index files without running code from them.

A checkpoint directory holds DCP's ``.metadata`` (the index of every shard) and our ``meta.pt`` (Lightning's loops,
callbacks, schedulers, the layout). Both are pickles, and a pickle can run any code while it loads: a checkpoint from
anywhere could then run code on every rank that opens it.

- ``meta.pt`` is read with ``torch.load(weights_only=True)``: tensors, plain containers and the few Lightning types a
  checkpoint holds. Pass ``weights_only=False`` (``trainer.fit(..., weights_only=False)``, as for any Lightning
  checkpoint) only for a checkpoint you trust.
- DCP reads ``.metadata`` with a bare ``pickle.load`` and torch offers no restricted reader for it, so
  :class:`SafeFileSystemReader` unpickles it with an allow-list of DCP's own metadata classes (the standard library's
  documented way to restrict globals) and refuses anything else.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = [
    "META_FILENAME",
    "METADATA_FILENAME",
    "HUGGING_FACE_KEY",
    "LAYOUT_KEY",
    "OPTIMIZER_HYPERPARAMETERS_KEY",
    "VERSIONS_KEY",
    "CheckpointError",
    "SafeFileSystemReader",
    "check_files",
    "check_shard_files",
    "lightning_entries",
    "read_index",
    "read_meta",
    "staging_path",
]

META_FILENAME = "meta.pt"
METADATA_FILENAME = ".metadata"  # DCP's index file
# meta.pt's entries of lightning-hybrid's own, beside Lightning's checkpoint dict
LAYOUT_KEY = "hybrid_layout"
VERSIONS_KEY = "hybrid_versions"
OPTIMIZER_HYPERPARAMETERS_KEY = "hybrid_optimizer_param_groups"
HUGGING_FACE_KEY = "hybrid_hugging_face"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot load: incomplete, corrupt, or from an incompatible model (raised on every rank)."""


# globals DCP's metadata pickles reference (torch 2.11-2.14): its own dataclasses, sizes, dtypes, layouts and paths
_DCP_MODULES = {"torch.distributed.checkpoint.metadata"}
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` refuses an index that would run code while loading.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> # dcp.load(state_dict, storage_reader=SafeFileSystemReader("last.ckpt"))
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILENAME if rank is None else f"__{rank}{METADATA_FILENAME}"
        path = Path(str(self.path)) / name
        try:
            with open(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"Cannot load checkpoint {path.parent}: its index {name} is not a plain DCP index ({error}). Loading"
                " it would run code stored in the file; it was refused."
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"Cannot load checkpoint {path.parent}: {name} holds no DCP index.")
        # as FileSystemReader.read_metadata does
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def staging_path(path: Path) -> Path:
    """Where a save into ``path`` writes until it commits (renamed to ``path`` once complete)."""
    return path.parent / f".{path.name}.partial"


def _meta_safe_globals() -> list[Any]:
    """Non-tensor types beyond plain containers that a lightning-hybrid checkpoint's extra state holds."""
    from torch.torch_version import TorchVersion  # a str: checkpoints written before versions were saved as str

    # Lightning saves hyper-parameters as a plain dict(hparams); tensors and containers need no allow-listing
    return [TorchVersion, pathlib.PosixPath, pathlib.WindowsPath]


def read_meta(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The non-tensor part of a checkpoint (Lightning's loops, callbacks, schedulers, the layout, versions).

    Read with ``torch.load(weights_only=True)`` unless ``weights_only=False`` is given for a trusted checkpoint.

    Example:
        >>> # read_meta(Path("last.ckpt"))["global_step"]
    """
    file = Path(path) / META_FILENAME
    if weights_only is False:
        return torch.load(file, weights_only=False)
    try:
        with torch.serialization.safe_globals(_meta_safe_globals()):
            return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if "Unsupported global" in line]
        first = lines[0].split(" was not")[0] if lines else type(error).__name__
        raise CheckpointError(
            f"Cannot load checkpoint {Path(path)}: {META_FILENAME} holds objects that only a full unpickle can build"
            f" ({first}), which can run code stored in the file, so it was refused. If you trust this checkpoint,"
            " load it with `trainer.fit(..., ckpt_path=..., weights_only=False)`."
        ) from None


def lightning_entries(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` (a checkpoint's ``meta.pt``) without lightning-hybrid's own entries: Lightning's checkpoint dict,
    less ``state_dict`` and ``optimizer_states`` (which are in DCP's files).

    Example:
        >>> lightning_entries({"epoch": 1, LAYOUT_KEY: {}})
        {'epoch': 1}
    """
    ours = (LAYOUT_KEY, VERSIONS_KEY, OPTIMIZER_HYPERPARAMETERS_KEY, HUGGING_FACE_KEY)
    return {k: v for k, v in meta.items() if k not in ours}


def check_files(path: Path) -> list[str]:
    """Problems visible from the file system alone: identical on every rank (they all read the same files)."""
    if not path.exists():
        hint = (
            f" A save into it did not finish ({staging_path(path).name} is left)."
            if staging_path(path).exists()
            else ""
        )
        return [f"{path} does not exist.{hint}"]
    if not path.is_dir():
        return [f"{path} is a file, not a lightning-hybrid checkpoint directory."]
    missing = [name for name in (METADATA_FILENAME, META_FILENAME) if not (path / name).is_file()]
    if missing:
        return [f"{path} is incomplete: {', '.join(missing)} missing (the save did not finish)."]
    return []


def check_shard_files(path: Path, metadata: Any) -> list[str]:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"shard file {name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"shard file {name} is truncated ({file.stat().st_size} bytes, the index needs {size})")
    return problems


def read_index(path: Path) -> tuple[Metadata, list[str]]:
    """DCP's index of checkpoint ``path`` and what is wrong with the shard files it names (missing, truncated). The
    index is unpickled: read it once the files passed their checks (``integrity.checkpoint_problems``)."""
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    return metadata, check_shard_files(path, metadata)
