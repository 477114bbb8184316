"""Consolidation: a sharded checkpoint directory -> full, unsharded weights in one safetensors file (no processes).

Tensors are read from DCP's files a few at a time (``dcp.load`` without a process group, into full-size tensors)
and appended to the output file as they come, so memory stays at about the largest tensor plus a small buffer; the
optimizer state is never read. A checkpoint of a Hugging Face model gives a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid.checkpoint.format import (
    CheckpointError,
    SafeFileSystemReader,
    check_files,
    check_shard_files,
    read_meta,
)
from lightning_hybrid.checkpoint.integrity import integrity_problems

__all__ = ["NATURAL_SHAPE_PREFIX", "consolidate"]

MODEL_PREFIX = "state_dict."
# DCP entries that record the real shape of a tensor saved through a view (fused projections under tensor parallel)
NATURAL_SHAPE_PREFIX = "natural_shape."
HUGGING_FACE_KEY = "hybrid_hugging_face"
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def natural_shape_entries(flat: dict[str, Any]) -> dict[str, str]:
    """``{NATURAL_SHAPE_PREFIX + key: "rows,cols"}`` for every tensor DCP will see through a view (saved with it)."""
    from lightning_hybrid.checkpoint.tensors import is_fused

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


def _write_safetensors(
    file: Path,
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterator[Tensor],
    metadata: dict[str, str],
) -> None:
    """Write the safetensors format (8-byte header length, JSON header, raw little-endian data) with the header first
    and the data streamed after it: ``safetensors.torch.save_file`` needs every tensor in memory at once."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in layout:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (_, shape, dtype), tensor in zip(layout, tensors):
            tensor = tensor.detach().to(dtype).reshape(shape).contiguous().cpu()
            out.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")


def consolidate(
    checkpoint: Union[str, Path],
    output: Union[str, Path],
    *,
    dtype: Optional[torch.dtype] = None,
    buffer_bytes: int = 256 * 2**20,
    verify: bool = True,
) -> Path:
    """Write the full model weights of a lightning-hybrid checkpoint directory as ``output/model.safetensors``.

    Keys are the LightningModule's ``state_dict`` keys, so ``module.load_state_dict(load_file(...), strict=True)``
    loads them into the single-device module. If the module held a Hugging Face model, the file holds that model's
    own keys instead and ``output`` also gets its ``config.json``: ``AutoModelForCausalLM.from_pretrained(output)``.
    ``dtype`` converts floating-point tensors (default: as saved). Reads at most ``buffer_bytes`` of tensors at a time
    (or one tensor, if larger). Needs no process group. Returns ``output``. First checks every file of the checkpoint
    against the size and hash its commit record holds, and raises :class:`CheckpointError` naming any that differs;
    ``verify=False`` skips the hashing (and accepts a checkpoint without a commit record).

    Example:
        >>> # consolidate("checkpoints/last.ckpt", "export")  # export/model.safetensors
        >>> # module.load_state_dict(safetensors.torch.load_file("export/model.safetensors"))
    """
    source, output = Path(checkpoint), Path(output)
    problems = check_files(source) or integrity_problems(source, verify=verify)  # before unpickling the index
    metadata = SafeFileSystemReader(str(source)).read_metadata() if not problems else None
    problems = problems or check_shard_files(source, metadata)
    if problems:
        raise CheckpointError(f"Cannot consolidate {source}:\n  " + "\n  ".join(problems))
    assert metadata is not None
    stored = metadata.state_dict_metadata
    shape_keys = [k for k in stored if k.startswith(NATURAL_SHAPE_PREFIX)]
    natural = _read(str(source), {k: None for k in shape_keys}) if shape_keys else {}
    hugging_face = read_meta(source).get(HUGGING_FACE_KEY)
    strip = MODEL_PREFIX + (hugging_face["prefix"] if hugging_face else "")
    entries = [
        (k, md)
        for k, md in stored.items()
        if k.startswith(strip) and isinstance(md, TensorStorageMetadata) and not k.startswith(NATURAL_SHAPE_PREFIX)
    ]
    if not entries:
        raise CheckpointError(f"{source} holds no model weights under {strip!r}.")

    def out_dtype(saved: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and saved.is_floating_point else saved

    layout = [
        (k[len(strip) :], _shape(natural.get(NATURAL_SHAPE_PREFIX + k), md), out_dtype(md.properties.dtype))
        for k, md in entries
    ]

    def tensors() -> Iterator[Tensor]:
        for batch in _batches(entries, buffer_bytes):
            request = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in batch}
            loaded = _read(str(source), request)
            for k, _ in batch:
                yield loaded.pop(k)

    output.mkdir(parents=True, exist_ok=True)
    _write_safetensors(output / "model.safetensors", layout, tensors(), {"format": "pt"})
    if hugging_face:
        config = json.loads(hugging_face["config"])
        config.setdefault("architectures", [hugging_face["architecture"]])
        config["architectures"] = config["architectures"] or [hugging_face["architecture"]]
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (output / "config.json").write_text(json.dumps(config, indent=2))
    return output


def hugging_face_info(module: torch.nn.Module) -> Optional[dict[str, str]]:
    """Where a Hugging Face model sits in ``module`` and its config, for :func:`consolidate` (None if there is none)."""
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
            }
    return None


def main(argv: Optional[list[str]] = None) -> Path:
    """``lightning-hybrid consolidate CKPT OUT [--dtype bfloat16]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-hybrid consolidate",
        description="Write the full weights of a sharded lightning-hybrid checkpoint as OUT/model.safetensors"
        " (plus OUT/config.json for a Hugging Face model, loadable with from_pretrained).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory written by HybridStrategy (e.g. last.ckpt)")
    parser.add_argument("output", help="output directory")
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
        out = consolidate(options.checkpoint, options.output, dtype=dtype, verify=not options.no_verify)
    except CheckpointError as error:  # a damaged or incomplete checkpoint: the message, not a traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"wrote {out / 'model.safetensors'}")
    return out
