"""Pretrained weights into a split model: each rank reads only the slices of the safetensors files it keeps.

The source is a Hugging Face folder (``model.safetensors``, or shards listed by ``model.safetensors.index.json``), the
output of ``lightning-hybrid consolidate`` (one ``model.safetensors``), or one ``.safetensors`` file. The module is
the one :func:`~lightning_hybrid.parallelize.parallelize` left: plain tensors, tensor-parallel DTensors (fused q|k|v
projections included), FSDP2 shards, pipeline stages without other stages' blocks. For every tensor of its
``state_dict`` a rank computes the global slab its local part covers (the same arithmetic DCP uses) and reads that
slab with safetensors' ``get_slice``, so no rank ever holds a whole tensor it does not keep.

Names: the module's ``state_dict`` names are matched to the file's keys by swapping one leading prefix (a wrapper's
``model.`` for a Hugging Face model inside a LightningModule, none for a consolidated checkpoint of the same module),
chosen as the swap that matches the most names on all ranks together. A name missing from the file falls back on a
weight tied to it (Hugging Face leaves ``lm_head.weight`` out when it is tied to the embedding). What is still
missing, any file key no rank reads, and every shape mismatch is raised as one :class:`HybridConfigError` on every
rank, before a byte of weights is read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._torch_compat import compute_local_shape_and_global_offset
from lightning_hybrid.agreement import raise_together
from lightning_hybrid.checkpoint.tensors import dcp_ready
from lightning_hybrid.config import HybridConfigError

__all__ = ["LoadReport", "load_pretrained", "load_pretrained_weights", "match_keys", "weight_files"]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
_SHOWN = 6  # names listed per kind of problem in an error


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did on this rank.

    Example:
        >>> LoadReport("w", 1, 1, 3, 96, "model.", "").tensors
        3
    """

    source: str
    """The folder or file read."""
    files: int
    """Safetensors files in the source."""
    files_read: int
    """Files this rank read tensor data from (those holding its shards)."""
    tensors: int
    """State-dict entries of this rank filled from the files."""
    bytes_read: int
    """Bytes this rank read from the files (in the files' dtype): its own shards only."""
    module_prefix: str
    """The prefix of the module's names swapped for ``file_prefix`` (``"model."`` for a wrapped Hugging Face model)."""
    file_prefix: str
    """The prefix the files' keys carry instead."""


def weight_files(source: Union[str, os.PathLike]) -> dict[str, Path]:
    """``{key: file}`` of a safetensors source: a folder with ``model.safetensors.index.json`` (its ``weight_map``) or
    ``model.safetensors``, or one ``.safetensors`` file. Reads the index only.

    Example:
        >>> # weight_files("Llama-3.2-1B")["model.embed_tokens.weight"]  # PosixPath('Llama-3.2-1B/model-00001-...')
    """
    path = Path(source)
    if path.is_file() and path.suffix == ".safetensors":
        return {key: path for key in _keys(path, source)}
    index = path / INDEX_FILENAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HybridConfigError(f"`pretrained_weights={str(source)!r}`: {index} has no `weight_map`.")
        files = {name: path / name for name in set(weight_map.values())}
        absent = sorted(name for name, file in files.items() if not file.is_file())
        if absent:
            raise HybridConfigError(
                f"`pretrained_weights={str(source)!r}`: {INDEX_FILENAME} names files that are not there: {absent}."
                " Copy the whole folder (every shard the index lists)."
            )
        return {key: files[name] for key, name in weight_map.items()}
    if (path / SINGLE_FILENAME).is_file():
        return {key: path / SINGLE_FILENAME for key in _keys(path / SINGLE_FILENAME, source)}
    raise HybridConfigError(
        f"`pretrained_weights={str(source)!r}` is not a safetensors source: give a folder holding {SINGLE_FILENAME}"
        f" or {INDEX_FILENAME} (what `save_pretrained` and `lightning-hybrid consolidate` write), or a .safetensors"
        " file. To resume a lightning-hybrid checkpoint directory, pass it as `trainer.fit(ckpt_path=...)` instead."
    )


def _open(file: Path, source: Union[str, os.PathLike]) -> Any:
    """safetensors' lazy reader of ``file`` (a context manager; nothing is read until asked), or a
    :class:`HybridConfigError` naming the file when its header cannot be read (safetensors checks there that the file
    holds all the data the header describes). Imported here: safetensors is an optional dependency (the ``hf``
    extra), checked with ``pretrained_weights`` (``config.py``)."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors' SafetensorError lives in its private Rust module
        size = file.stat().st_size if file.is_file() else 0
        raise HybridConfigError(
            f"`pretrained_weights={str(source)!r}`: the file {file} ({size:,} bytes) is not a readable safetensors"
            f" file ({error}): it is damaged or incomplete, as an interrupted download or copy leaves it. Download"
            " or copy that file again (its size must match the source's)."
        ) from error


def _keys(file: Path, source: Union[str, os.PathLike]) -> list[str]:
    with _open(file, source) as handle:
        return list(handle.keys())


def _prefixes(name: str, depth: int) -> Iterator[str]:
    """``""`` and the first ``depth`` dotted prefixes of ``name`` (each ending with a dot)."""
    yield ""
    parts = name.split(".")[:-1]
    for i in range(1, min(depth, len(parts)) + 1):
        yield ".".join(parts[:i]) + "."


def _swap(name: str, module_prefix: str, file_prefix: str) -> Optional[str]:
    return file_prefix + name[len(module_prefix) :] if name.startswith(module_prefix) else None


def prefix_scores(names: list[str], keys: set[str], depth: int = 3) -> dict[tuple[str, str], int]:
    """How many of ``names`` each ``(module prefix, file prefix)`` swap maps onto ``keys``."""
    module_side = {p for n in names for p in _prefixes(n, depth)}
    file_side = {p for k in keys for p in _prefixes(k, 2)}
    scores: dict[tuple[str, str], int] = {}
    for mp in module_side:
        for fp in file_side:
            hits = sum(1 for n in names if _swap(n, mp, fp) in keys)
            if hits:
                scores[(mp, fp)] = hits
    return scores


def _best(scores: dict[tuple[str, str], int]) -> tuple[str, str]:
    # most names matched; then the smallest change of names (the same choice on every rank: no tie is left open)
    return min(scores, key=lambda pair: (-scores[pair], len(pair[0]) + len(pair[1]), pair)) if scores else ("", "")


def match_keys(
    names: list[str],
    keys: set[str],
    *,
    prefixes: Optional[tuple[str, str]] = None,
    aliases: Optional[Mapping[str, str]] = None,
    key_map: Optional[Callable[[str], Optional[str]]] = None,
) -> tuple[dict[str, str], list[str]]:
    """Map module state-dict ``names`` to file ``keys``: returns ``({name: key}, missing names)``.

    ``prefixes`` is the ``(module prefix, file prefix)`` swap (default: the best for these names, see
    :func:`prefix_scores`); a name with no key takes its tied partner's (``aliases``: name -> name); ``key_map``
    replaces all of this (return None for a name to leave it as it is).

    Example:
        >>> match_keys(["model.lm_head.weight", "model.model.norm.weight"], {"lm_head.weight", "model.norm.weight"})
        ({'model.lm_head.weight': 'lm_head.weight', 'model.model.norm.weight': 'model.norm.weight'}, [])
    """
    if key_map is not None:
        mapped = {n: key_map(n) for n in names}
        return {n: k for n, k in mapped.items() if k is not None}, []
    module_prefix, file_prefix = prefixes if prefixes is not None else _best(prefix_scores(names, keys))
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in names:
        key = _swap(name, module_prefix, file_prefix)
        if key not in keys and aliases and name in aliases:
            key = _swap(aliases[name], module_prefix, file_prefix)
        if key in keys:
            found[name] = key
        else:
            missing.append(name)
    return found, missing


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (one object all-gather; just ``[obj]`` without a process group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _pieces(target: Tensor) -> list[tuple[Tensor, tuple[slice, ...]]]:
    """(local tensor, the slab of the global tensor it holds) for each contiguous slab this rank keeps of ``target``.

    A fused projection's DTensor (q|k|v under tensor parallel) keeps rows of each of its ``k`` blocks: it is seen
    through DCP's ``[k, rows/k, ...]`` view (:func:`~lightning_hybrid.checkpoint.tensors.dcp_ready`), whose local part
    is one rectangular slab, and read as one slab of rows per block.
    """
    if not isinstance(target, DTensor):
        return [(target, tuple(slice(0, s) for s in target.shape))]
    view = dcp_ready(target)
    sizes, offsets = compute_local_shape_and_global_offset(view.shape, view.device_mesh, view.placements)
    local = view.to_local()
    if any(s == 0 for s in sizes):
        return []  # an uneven FSDP2 shard: this rank keeps nothing of it
    if view.dim() == target.dim():
        return [(local, tuple(slice(o, o + s) for o, s in zip(offsets, sizes)))]
    # the block view: dimension d of the natural tensor is [k, rows/k] in the view
    d = next(i for i, (a, b) in enumerate(zip(view.shape, target.shape)) if a != b)
    rows = view.shape[d + 1]
    pieces = []
    for b in range(offsets[d], offsets[d] + sizes[d]):
        start = b * rows + offsets[d + 1]
        natural = (*zip(offsets[:d], sizes[:d]), (start, sizes[d + 1]), *zip(offsets[d + 2 :], sizes[d + 2 :]))
        pieces.append((local.select(d, b - offsets[d]), tuple(slice(o, o + s) for o, s in natural)))
    return pieces


def _ignored_unexpected(module: nn.Module, module_prefix: str) -> list[str]:
    """The key patterns a Hugging Face model at ``module_prefix`` declares safe to ignore in its files."""
    try:
        model = module.get_submodule(module_prefix.rstrip("."))
    except AttributeError:
        return []
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


def _shown(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


@torch.no_grad()
def load_pretrained(
    module: nn.Module,
    source: Union[str, os.PathLike],
    *,
    aliases: Optional[Mapping[str, str]] = None,
    key_map: Optional[Callable[[str], Optional[str]]] = None,
) -> LoadReport:
    """Fill ``module``'s parameters and persistent buffers in place from the safetensors weights at ``source``.

    Works on the module as :func:`~lightning_hybrid.parallelize.parallelize` leaves it: each rank reads the slices it
    keeps and nothing else, casting to each tensor's dtype. Collective (a few small object all-gathers): every rank
    calls it. Raises :class:`HybridConfigError` on every rank alike, before reading any weights, for names the files
    lack, file keys no rank reads (unless a Hugging Face model declares them ignorable) and shape mismatches.
    ``aliases`` maps a name to a name tied to it (read in its place if the file lacks it); ``key_map`` gives the file
    key for each name instead of the automatic prefix swap (None: keep the tensor as it is).

    Example:
        >>> import tempfile, safetensors.torch
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.torch.save_file({"weight": torch.ones(2, 2)}, f"{folder}/model.safetensors")
        >>> net = nn.Sequential(nn.Linear(2, 2, bias=False))
        >>> load_pretrained(net, folder).tensors, net[0].weight.sum().item()
        (1, 4.0)
    """
    where = f"`pretrained_weights={str(source)!r}`"
    state = {n: t for n, t in module.state_dict().items() if isinstance(t, Tensor)}
    names = list(state)
    with ExitStack() as stack:
        # every step that can fail on one rank alone (a file missing or damaged on one node) fails on all of them
        with raise_together():
            files = weight_files(source)
            keys = set(files)
            handles = {f: stack.enter_context(_open(f, source)) for f in sorted(set(files.values()))}
            scores = prefix_scores(names, keys) if key_map is None else {}
        # 1. the prefix swap, over every rank's names: a pipeline stage alone may not tell which one is right
        total: dict[tuple[str, str], int] = {}
        for rank_scores in _gather(scores):
            for pair, hits in rank_scores.items():
                total[pair] = total.get(pair, 0) + hits
        prefixes = _best(total)
        # 2. names and shapes, from the files' headers (no tensor data yet)
        with raise_together():
            found, missing = match_keys(names, keys, prefixes=prefixes, aliases=aliases, key_map=key_map)
            shapes = {key: list(handles[files[key]].get_slice(key).get_shape()) for key in set(found.values())}
            mismatched = [
                f"{n} (file {found[n]}: {shapes[found[n]]}, model: {list(state[n].shape)})"
                for n in found
                if shapes[found[n]] != list(state[n].shape)
            ]
        # 3. one verdict on every rank: a key is unexpected only if no rank reads it
        gathered = _gather((missing, mismatched, sorted(set(found.values()))))
        _check_fit(where, module, keys, prefixes, gathered, checks_unexpected=key_map is None)
        # 4. this rank's slabs only; tensors that share storage (weights tied on this rank) are read once
        with raise_together():
            read_bytes, read_from = _read_slabs(state, found, files, handles)
    return LoadReport(
        source=str(source),
        files=len(set(files.values())),
        files_read=len(read_from),
        tensors=len(found),
        bytes_read=read_bytes,
        module_prefix=prefixes[0],
        file_prefix=prefixes[1],
    )


def _check_fit(
    where: str,
    module: nn.Module,
    keys: set[str],
    prefixes: tuple[str, str],
    gathered: list[tuple[list[str], list[str], list[str]]],
    *,
    checks_unexpected: bool,
) -> None:
    """Raise one :class:`HybridConfigError` (the same on every rank: built from every rank's findings) if the files
    do not fit the model."""
    missing = sorted({m for rank in gathered for m in rank[0]})
    mismatched = sorted({m for rank in gathered for m in rank[1]})
    read = {k for rank in gathered for k in rank[2]}
    ignored = [re.compile(p) for p in _ignored_unexpected(module, prefixes[0])]
    unexpected = sorted(k for k in keys - read if not any(p.search(k) for p in ignored)) if checks_unexpected else []
    problems = []
    if missing:
        problems.append(f"the model's {_shown(missing)} not in the files")
    if unexpected:
        problems.append(f"the files' {_shown(unexpected)} not in the model")
    if mismatched:
        problems.append(f"shapes differ: {_shown(mismatched)}")
    if problems:
        swap = f"model names {prefixes[0] or '(no prefix)'!r} -> file keys {prefixes[1] or '(no prefix)'!r}"
        raise HybridConfigError(
            f"{where} does not fit the model ({swap}): " + "; ".join(problems) + ". Give the weights of this"
            " architecture and configuration (a Hugging Face folder of the model the LightningModule wraps, or"
            " `lightning-hybrid consolidate` output of this LightningModule), or call"
            " `lightning_hybrid.checkpoint.pretrained.load_pretrained(..., key_map=...)` to name the keys."
        )


def _read_slabs(
    state: dict[str, Tensor], found: dict[str, str], files: dict[str, Path], handles: dict
) -> tuple[int, set[Path]]:
    """Copy each tensor's local slabs from the files; returns the bytes read and the files they came from."""
    done: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    read_bytes, read_from = 0, set()
    for name, key in found.items():
        target = state[name]
        local = target.to_local() if isinstance(target, DTensor) else target
        identity = (local.data_ptr(), tuple(local.shape), tuple(local.stride()))
        if local.numel() and identity in done:
            continue
        done.add(identity)
        handle = handles[files[key]]
        stored = handle.get_slice(key)
        for piece, slab in _pieces(target):
            data = stored[slab] if slab else handle.get_tensor(key)  # a 0-d tensor has no slab to slice
            piece.copy_(data.reshape(piece.shape))  # copy_ casts: bf16 files into fp32 parameters
            read_bytes += data.numel() * data.element_size()
            read_from.add(files[key])
    return read_bytes, read_from


def load_pretrained_weights(module: nn.Module, source: Optional[str], parallelized: Any) -> Optional[LoadReport]:
    """``HybridStrategy(pretrained_weights=source)``: :func:`load_pretrained` into the module just split by
    :func:`~lightning_hybrid.parallelize.parallelize` (its :class:`~lightning_hybrid.parallelize.Parallelized` gives
    the tied weights); nothing without a source. Collective.

    Example:
        >>> load_pretrained_weights(nn.Linear(2, 2), None, None) is None
        True
    """
    if source is None:
        return None
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    tied = parallelized.structure.tied_parameters if parallelized is not None else []
    report = load_pretrained(module, source, aliases={**dict(tied), **{b: a for a, b in tied}})
    swap = f" (names {report.module_prefix!r} -> {report.file_prefix!r})" if report.module_prefix else ""
    rank_zero_info(
        f"lightning-hybrid: pretrained weights from {source}{swap}: {report.tensors} tensors, rank 0 read"
        f" {report.bytes_read / 2**20:.1f} MiB of its shards from {report.files_read} of the {report.files} file(s)"
    )
    return report
