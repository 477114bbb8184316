"""Consolidation: a sharded checkpoint directory -> full, unsharded weights (no processes).

Two outputs. A folder in Hugging Face's layout: safetensors files of at most ``max_shard_size`` each
(``model-00001-of-0000n.safetensors`` plus ``model.safetensors.index.json``, or one ``model.safetensors`` when
everything fits one shard, as ``save_pretrained`` writes them); tensors are read from DCP's files a few at a time
(``dcp.load`` without a process group, into full-size tensors) and appended to the current file as they come, so
memory stays at about the largest tensor plus a small buffer, never the whole model. Or one Lightning ``.ckpt`` file
(an output path ending in ``.ckpt``) that ``LightningModule.load_from_checkpoint`` reads: that one holds every weight
in memory at once. The optimizer state is never read. A checkpoint of a Hugging Face model gives a folder
``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid.checkpoint.format import (
    HUGGING_FACE_KEY,
    CheckpointError,
    SafeFileSystemReader,
    lightning_entries,
    read_index,
    read_meta,
)
from lightning_hybrid.checkpoint.integrity import checkpoint_problems
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import is_fused

__all__ = ["NATURAL_SHAPE_PREFIX", "consolidate", "parse_shard_size"]

MODEL_PREFIX = "state_dict."
# DCP entries that record the real shape of a tensor saved through a view (fused projections under tensor parallel)
NATURAL_SHAPE_PREFIX = "natural_shape."
DEFAULT_MAX_SHARD_SIZE = "5GB"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# the weight files of an earlier export into the same folder (removed unless rewritten, as save_pretrained does)
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# decimal units, as huggingface_hub's parse_size_to_int (which transformers' max_shard_size goes through)
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def natural_shape_entries(flat: dict[str, Any]) -> dict[str, str]:
    """``{NATURAL_SHAPE_PREFIX + key: "rows,cols"}`` for every tensor DCP will see through a view (saved with it)."""
    return {NATURAL_SHAPE_PREFIX + k: ",".join(map(str, v.shape)) for k, v in flat.items() if is_fused(v)}


def _shape(recorded: Optional[str], md: TensorStorageMetadata) -> tuple[int, ...]:
    return tuple(int(x) for x in recorded.split(",")) if recorded else tuple(md.size)


def _read(reader_path: str, request: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": reading in one process is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(request, storage_reader=SafeFileSystemReader(reader_path), no_dist=True)
    return request


def _batches(entries: list[tuple[str, TensorStorageMetadata]], budget: int) -> Iterator[list[tuple[str, Any]]]:
    batch: list[tuple[str, Any]] = []
    size = 0
    for key, md in entries:
        nbytes = md.size.numel() * md.properties.dtype.itemsize
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append((key, md))
        size += nbytes
    if batch:
        yield batch


def parse_shard_size(value: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or a string with a decimal unit as transformers' ``max_shard_size`` takes
    it (``"500MB"`` is 500 * 10**6 bytes, ``"5GB"`` 5 * 10**9; KB, MB, GB, TB), or a string of digits (bytes).

    Example:
        >>> parse_shard_size("500MB"), parse_shard_size("5GB"), parse_shard_size(1024), parse_shard_size("2048")
        (500000000, 5000000000, 1024, 2048)
    """
    size: Optional[int] = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            size = int(text)
        elif text[-2:].upper() in _SIZE_UNITS:
            try:
                size = int(float(text[:-2].strip()) * _SIZE_UNITS[text[-2:].upper()])
            except ValueError:
                size = None
    if size is None or size < 1:
        raise HybridConfigError(
            f"`max_shard_size` must be a positive size in bytes, got {value!r}. Give an int (bytes) or a string such"
            " as '500MB' or '5GB' (units KB, MB, GB, TB, decimal: 1GB = 10**9 bytes, as in transformers)."
        )
    return size


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _split(layout: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[int]]:
    """Indices of ``layout`` per shard, by huggingface_hub's rule (``split_torch_state_dict_into_shards``, which
    ``save_pretrained`` uses): in order, a new shard when the next tensor would overflow the current one, and a tensor
    larger than ``max_bytes`` alone in a shard of its own (placed where it comes, the current shard staying open)."""
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, (_, shape, dtype) in enumerate(layout):
        nbytes = _nbytes(shape, dtype)
        if nbytes > max_bytes:
            shards.append([index])
            continue
        if size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _write_safetensors(
    file: Path,
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterator[Tensor],
    metadata: dict[str, str],
) -> None:
    """Write the safetensors format (8-byte header length, JSON header, raw little-endian data) with the header first
    and the data streamed after it: ``safetensors.torch.save_file`` needs every tensor in memory at once. Takes one
    tensor from ``tensors`` per entry of ``layout`` (and no more: the rest is for the next file)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in layout:
        nbytes = _nbytes(shape, dtype)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (_, shape, dtype), tensor in zip(layout, tensors):  # layout first: zip stops before taking a tensor more
            tensor = tensor.detach().to(dtype).reshape(shape).contiguous().cpu()
            if tensor.numel():  # the array's own memory, not a bytes copy of it (that would double the peak)
                out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def _write_hugging_face_layout(
    output: Path,
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    read: Callable[[list[int]], Iterator[Tensor]],
    max_bytes: int,
    count_parameters: bool,
) -> list[Path]:
    """The weights as ``save_pretrained`` lays them out: one ``model.safetensors`` if they fit ``max_bytes``, else
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json`` (its ``metadata.total_size`` and
    ``weight_map``, and ``total_parameters`` for a Hugging Face model, written as transformers writes them). Removes
    the weight files of an earlier export into ``output`` that this one does not rewrite. ``read(indices)`` gives
    the tensors of those entries of ``layout``, in that order. Returns the files written."""
    shards = _split(layout, max_bytes)
    names = (
        [SAFE_WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = [output / name for name in names]
    if len(shards) > 1:
        written.append(output / SAFE_WEIGHTS_INDEX_NAME)
    for stale in output.iterdir():  # from_pretrained would read a stale model.safetensors before a new index
        if _WEIGHT_FILE.fullmatch(stale.name) and stale not in written and stale.is_file():
            stale.unlink()
    weight_map: dict[str, str] = {}
    # one stream in file order, which is not the layout's where a tensor over the limit got a file of its own
    tensors = read([i for indices in shards for i in indices])
    for name, indices in zip(names, shards):
        part = [layout[i] for i in indices]
        _write_safetensors(output / name, part, tensors, {"format": "pt"})
        weight_map.update({key: name for key, _, _ in part})
    if len(shards) > 1:
        metadata: dict[str, int] = {"total_size": sum(_nbytes(shape, dtype) for _, shape, dtype in layout)}
        if count_parameters:  # save_pretrained's num_parameters(): every exported tensor is a parameter there
            metadata["total_parameters"] = sum(int(torch.Size(shape).numel()) for _, shape, _ in layout)
        index = {"metadata": metadata, "weight_map": weight_map}
        (output / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


GENERATION_CONFIG_NAME = "generation_config.json"  # transformers' name, beside config.json


def consolidate(
    checkpoint: Union[str, Path],
    output: Union[str, Path],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    buffer_bytes: int = 256 * 2**20,
    verify: bool = True,
) -> Path:
    """Write the full model weights of a lightning-hybrid checkpoint directory, without any process group.

    - ``output`` a folder (default): the weights in Hugging Face's safetensors layout, files of at most
      ``max_shard_size`` (bytes, or ``"500MB"``, ``"5GB"``, as transformers' ``max_shard_size``; a tensor larger
      than that gets a file of its own): ``model-00001-of-0000n.safetensors`` ... plus
      ``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits one file. Keys are the
      LightningModule's ``state_dict`` keys. If the module held a Hugging Face model, the files hold that model's own
      keys instead and ``output`` also gets its ``config.json``: ``AutoModelForCausalLM.from_pretrained(output)``.
      Memory: the tensors being read (at most ``buffer_bytes``, or one tensor if larger) plus one tensor's copy.
    - ``output`` ending in ``.ckpt``: one Lightning checkpoint file (``torch.save``) that
      ``MyModule.load_from_checkpoint(output)`` reads: ``state_dict`` with the module's own keys, the
      hyper-parameters, epoch, global step, loops and the rest of what Lightning saved, except the optimizer state
      (a weights-only checkpoint, as ``ModelCheckpoint(save_weights_only=True)`` writes). Holds every weight in
      memory at once.

    ``dtype`` converts floating-point tensors (default: as saved). First checks every file of the checkpoint against
    the size and hash its commit record holds, and raises :class:`CheckpointError` naming any that differs;
    ``verify=False`` skips the hashing (and accepts a checkpoint without a commit record). Returns ``output``.

    Example:
        >>> # consolidate("checkpoints/last.ckpt", "export", max_shard_size="2GB")  # export/model-00001-of-0000n...
        >>> # consolidate("checkpoints/last.ckpt", "last-full.ckpt")  # MyModule.load_from_checkpoint("last-full.ckpt")
    """
    source, output = Path(checkpoint), Path(output)
    lightning_file = output.suffix == ".ckpt"
    max_bytes = parse_shard_size(max_shard_size)  # before any work: a bad size is the caller's to fix
    if lightning_file and output.is_dir():
        raise HybridConfigError(
            f"`output` {str(output)!r} ends in .ckpt, which asks for one Lightning checkpoint file, but it is a"
            " directory. Give a new file name ending in .ckpt, or a folder name without .ckpt for safetensors files."
        )
    if lightning_file:
        checkpoint = consolidated_checkpoint(source, dtype=dtype, buffer_bytes=buffer_bytes, verify=verify)
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(f".{output.name}.partial")  # a crash mid-write must not leave a truncated .ckpt
        torch.save(checkpoint, partial)
        partial.replace(output)
        return output
    layout, read, meta = _weights(source, "consolidate", dtype, buffer_bytes, verify, own_keys=False)
    hugging_face = meta.get(HUGGING_FACE_KEY)
    output.mkdir(parents=True, exist_ok=True)
    _write_hugging_face_layout(output, layout, read, max_bytes, count_parameters=hugging_face is not None)
    if hugging_face:
        config = json.loads(hugging_face["config"])
        config.setdefault("architectures", [hugging_face["architecture"]])
        config["architectures"] = config["architectures"] or [hugging_face["architecture"]]
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (output / "config.json").write_text(json.dumps(config, indent=2))
        if hugging_face.get("generation_config"):  # the source folder's, as save_pretrained writes the model's
            (output / GENERATION_CONFIG_NAME).write_text(hugging_face["generation_config"])
    return output


def consolidated_checkpoint(
    checkpoint: Union[str, Path],
    *,
    dtype: Optional[torch.dtype] = None,
    buffer_bytes: int = 256 * 2**20,
    verify: bool = True,
) -> dict[str, Any]:
    """A lightning-hybrid checkpoint directory as one Lightning checkpoint dict in memory (what ``consolidate(...,
    "x.ckpt")`` writes): the module's full ``state_dict`` (its own keys), the hyper-parameters, epoch, global step,
    loops and the rest of what Lightning saved, no optimizer state. Checks the files as :func:`consolidate` does.

    Example:
        >>> # consolidated_checkpoint("checkpoints/last.ckpt")["state_dict"]["model.wte.weight"].shape
    """
    source = Path(checkpoint)
    layout, read, meta = _weights(source, "load", dtype, buffer_bytes, verify, own_keys=True)
    return lightning_checkpoint_dict(layout, read(list(range(len(layout)))), lightning_entries(meta))


def _weights(
    source: Path, verb: str, dtype: Optional[torch.dtype], buffer_bytes: int, verify: bool, *, own_keys: bool
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Callable[[list[int]], Iterator[Tensor]], dict[str, Any]]:
    """The checkpoint's model weights: their (name, shape, dtype) in writing order, a reader of them by index, and
    ``meta.pt``. Names are the LightningModule's (``own_keys``) or, when it held a Hugging Face model, that model's
    own, its tied copies left out as ``save_pretrained`` leaves them out. Raises :class:`CheckpointError` naming each
    file that fails its checks (``verb``: what was asked, for the message)."""
    problems = checkpoint_problems(source, verify=verify)  # before unpickling the index
    metadata, problems = read_index(source) if not problems else (None, problems)
    if problems:
        raise CheckpointError(f"Cannot {verb} {source}:\n  " + "\n  ".join(problems))
    assert metadata is not None
    stored = metadata.state_dict_metadata
    shape_keys = [k for k in stored if k.startswith(NATURAL_SHAPE_PREFIX)]
    natural = _read(str(source), {k: None for k in shape_keys}) if shape_keys else {}
    meta = read_meta(source)
    # a Lightning file keeps the module's own keys; a folder those of the Hugging Face model inside it, if any
    hugging_face = None if own_keys else meta.get(HUGGING_FACE_KEY)
    strip = MODEL_PREFIX + (hugging_face["prefix"] if hugging_face else "")
    tied = {strip + key for key in hugging_face.get("tied", [])} if hugging_face else set()  # as save_pretrained
    entries = [
        (k, md)
        for k, md in stored.items()
        if k.startswith(strip)
        and isinstance(md, TensorStorageMetadata)
        and not k.startswith(NATURAL_SHAPE_PREFIX)
        and k not in tied
    ]
    if not entries:
        raise CheckpointError(f"{source} holds no model weights under {strip!r}.")
    if hugging_face:  # shards are cut in save_pretrained's order; DCP's index spreads copies over the ranks
        rank = {strip + key: i for i, key in enumerate(_state_dict_order(hugging_face))}
        entries.sort(key=lambda entry: rank.get(entry[0], len(rank)))  # stable: others keep the checkpoint's order

    def out_dtype(saved: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and saved.is_floating_point else saved

    layout = [
        (k[len(strip) :], _shape(natural.get(NATURAL_SHAPE_PREFIX + k), md), out_dtype(md.properties.dtype))
        for k, md in entries
    ]

    def read(indices: list[int]) -> Iterator[Tensor]:
        for batch in _batches([entries[i] for i in indices], buffer_bytes):
            request = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in batch}
            loaded = _read(str(source), request)
            for k, _ in batch:
                yield loaded.pop(k)

    return layout, read, meta


def lightning_checkpoint_dict(
    layout: list[tuple[str, tuple[int, ...], torch.dtype]], tensors: Iterator[Tensor], lightning: dict[str, Any]
) -> dict[str, Any]:
    """A checkpoint dict in Lightning's format (what a ``.ckpt`` file holds): what Lightning saved in ``meta.pt``
    (epoch, global step, version, loops, hyper-parameters, callbacks, ...) plus the full ``state_dict``. No
    ``optimizer_states``: the checkpoint keeps each parameter's optimizer state, but not which parameter group of
    torch's positional ``state_dict`` format it belongs to, so Lightning would refuse to resume training from it as
    from any weights-only checkpoint (resume from the sharded one).

    Example:
        >>> lightning_checkpoint_dict([("w", (2,), torch.float32)], iter([torch.ones(2)]), {"epoch": 1})["state_dict"]
        {'w': tensor([1., 1.])}
    """
    state_dict = {
        name: tensor.detach().to(dtype).reshape(shape).contiguous()
        for (name, shape, dtype), tensor in zip(layout, tensors)
    }
    return {**lightning, "state_dict": state_dict}


def hugging_face_info(
    module: torch.nn.Module, weights_source: Union[str, Path, None] = None
) -> Optional[dict[str, Any]]:
    """Where a Hugging Face model sits in ``module``, its config, the weights ``save_pretrained`` leaves out as tied
    copies and its generation config, for :func:`consolidate` (None if there is none).

    The generation config is the one of the folder the weights came from (``weights_source``, the strategy's
    ``pretrained_weights``), when it has a ``generation_config.json``; else the model's own when it did not derive it
    from its model config (``from_pretrained`` read it from a folder, or the user set it): what ``save_pretrained``
    would write for it.

    Example:
        >>> hugging_face_info(torch.nn.Linear(2, 2)) is None
        True
    """
    import sys

    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return {
                "prefix": f"{name}." if name else "",
                "config": sub.config.to_json_string(),
                "architecture": type(sub).__name__,
                "tied": _tied_copies(sub),
                "generation_config": _generation_config(sub, weights_source),
            }
    return None


def _generation_config(model: torch.nn.Module, weights_source: Union[str, Path, None]) -> Optional[str]:
    """The generation config to export with ``model``, as JSON text (see :func:`hugging_face_info`), or None."""
    source = Path(weights_source) / GENERATION_CONFIG_NAME if weights_source is not None else None
    if source is not None and source.is_file():
        return source.read_text()
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    if generation is None or not can_generate or getattr(generation, "_from_model_config", False):
        return None
    return generation.to_json_string()


def _state_dict_order(hugging_face: dict[str, Any]) -> list[str]:
    """The Hugging Face model's ``state_dict`` keys in its own order, from the model built on the meta device (no
    memory) from the recorded architecture and config; empty, with a warning, if transformers cannot build it (the
    export then keeps the checkpoint's order, and only the split into files may differ from save_pretrained's)."""
    import warnings

    try:
        import transformers

        cls = getattr(transformers, hugging_face["architecture"])
        config = cls.config_class.from_dict(json.loads(hugging_face["config"]))
        with torch.device("meta"):
            return list(cls(config).state_dict())
    except Exception as error:  # any failure to rebuild the model only costs the order, never the export
        warnings.warn(
            f"Could not build {hugging_face.get('architecture')} on the meta device ({type(error).__name__}: {error}):"
            " the safetensors files follow the checkpoint's order, not save_pretrained's.",
            stacklevel=3,
        )
        return []


def _tied_copies(model: torch.nn.Module) -> list[str]:
    """The keys a Hugging Face model declares as tied copies (``_tied_weights_keys``: ``{"lm_head.weight":
    "model.embed_tokens.weight"}``), when its config ties them: ``save_pretrained`` writes only the source, and
    ``from_pretrained`` ties the copy back. Read from the declaration and the config, not from tensor identity, which
    tensor parallel (DTensors) and pipeline stages (separate copies) do not keep."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return []
    tied: list[str] = []
    for name, sub in model.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or {}
        tied += [f"{name}.{key}" if name else key for key in declared if isinstance(key, str)]
    return tied


def main(argv: Optional[list[str]] = None) -> Path:
    """``lightning-hybrid consolidate CKPT OUT [--max-shard-size 5GB] [--dtype bfloat16] [--no-verify]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-hybrid consolidate",
        description="Write the full weights of a sharded lightning-hybrid checkpoint. OUT a folder: safetensors files"
        " in Hugging Face's layout (model-00001-of-0000n.safetensors ... plus model.safetensors.index.json, or one"
        " model.safetensors when all fits one file; plus config.json for a Hugging Face model, loadable with"
        " from_pretrained), written tensor by tensor: memory stays near the largest tensor. OUT ending in .ckpt: one"
        " Lightning checkpoint file for MyModule.load_from_checkpoint(OUT) (weights and hyper-parameters, no"
        " optimizer state; holds the whole model in memory).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory written by HybridStrategy (e.g. last.ckpt)")
    parser.add_argument("output", help="output folder, or a file name ending in .ckpt for one Lightning checkpoint")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file: bytes, or e.g. 500MB, 5GB (decimal units, as transformers' max_shard_size;"
        f" a larger tensor gets a file of its own). Default {DEFAULT_MAX_SHARD_SIZE}",
    )
    parser.add_argument("--dtype", default=None, help="convert floating-point weights, e.g. bfloat16")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking every file's hash against the checkpoint's commit record (faster; also reads a checkpoint"
        " without one)",
    )
    options = parser.parse_args(argv)
    dtype = getattr(torch, options.dtype, None) if options.dtype else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {options.dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    try:
        out = consolidate(
            options.checkpoint,
            options.output,
            dtype=dtype,
            max_shard_size=options.max_shard_size,
            verify=not options.no_verify,
        )
    except (CheckpointError, HybridConfigError) as error:  # the message, not a traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if out.suffix == ".ckpt":
        print(f"wrote {out}")
    elif (out / SAFE_WEIGHTS_INDEX_NAME).is_file():
        shards = set(json.loads((out / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"].values())
        print(f"wrote {len(shards)} safetensors files and {out / SAFE_WEIGHTS_INDEX_NAME}")
    else:
        print(f"wrote {out / SAFE_WEIGHTS_NAME}")
    return out
