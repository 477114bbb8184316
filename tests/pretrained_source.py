"""Pretrained sources for the multi-process scenarios (tests/test_pretrained.py), and a count of what each rank reads.

A scenario's ``"pretrained"`` entry says what to start from: ``{"write": "hf", "seed", "max_shard_size",
"model_kwargs"}`` (a Hugging Face ``save_pretrained`` folder, sharded with an index, of the scenario's Llama with
weights drawn from ``seed``), or ``{"write": "consolidated", "checkpoint": glob}`` (``consolidate`` of a checkpoint an
earlier scenario of the group saved). Rank 0 writes it; the other ranks wait for it (no process group exists yet).
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import lightning_hybrid.checkpoint.pretrained as loader

_WAIT_S = 300
_ORIGINAL_OPEN = loader._open


def pretrained_folder(name: str, out_dir: Path) -> Path:
    return out_dir / f"{name}-weights"


def write_hf(
    model: str, model_kwargs: dict[str, Any], seed: int, folder: Path, max_shard_size: str,
    generation: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """``save_pretrained`` of the scenario's module's Hugging Face model with weights unlike the module's own
    initialization (each perturbed by seeded noise), so a load that does nothing cannot pass; ``generation`` sets
    entries of its generation config (written to ``generation_config.json``)."""
    from tests.harness import build_module

    source = build_module(model, **model_kwargs)
    if getattr(source, "model", None) is None:  # a module that builds its network in configure_model
        source.configure_model()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    if generation:
        source.model.generation_config.update(**generation)
    source.model.save_pretrained(folder, max_shard_size=max_shard_size)


def prepare(scenario: dict[str, Any], out_dir: Path) -> str:
    """The scenario's pretrained source, written by rank 0 (every rank returns its path once it exists)."""
    spec, folder = scenario["pretrained"], pretrained_folder(scenario["name"], out_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        if spec["write"] == "hf":
            kwargs = {**scenario.get("model_kwargs", {}), **spec.get("model_kwargs", {})}
            write_hf(scenario["model"], kwargs, spec["seed"], partial, spec.get("max_shard_size", "20KB"),
                     spec.get("generation"))  # fmt: skip
        else:
            from lightning_hybrid.checkpoint import consolidate

            checkpoint = sorted(glob.glob(str(out_dir / spec["checkpoint"])))
            assert checkpoint, f"no checkpoint {spec['checkpoint']} in {out_dir}: its scenario must run first"
            consolidate(checkpoint[-1], partial)
        partial.rename(folder)  # whole or not at all: the other ranks wait for this name
    deadline = time.monotonic() + _WAIT_S
    while not folder.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {folder}")
        time.sleep(0.2)
    return str(folder)


class ReadCounter:
    """Counts the bytes every safetensors read of the loader returns, by wrapping the loader's ``_open`` (its one
    call of ``safe_open``): an independent measure of what a rank read (the loader's own report is not trusted
    here). A counter left installed by a failed scenario is replaced by the next one (each wraps the original)."""

    def __init__(self) -> None:
        self.original = _ORIGINAL_OPEN
        self.bytes = 0
        self.largest = 0  # the largest single read, in bytes
        self.files: set[str] = set()  # the files tensor data was read from
        counter = self

        class _Slice:
            def __init__(self, inner: Any, file: str) -> None:
                self.inner, self.file = inner, file

            def __getitem__(self, index: Any) -> torch.Tensor:
                return counter._count(self.inner[index], self.file)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        class _Handle:
            def __init__(self, inner: Any, file: str) -> None:
                self.inner, self.file = inner, file

            def __enter__(self) -> _Handle:
                self.inner = self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> Any:
                return self.inner.__exit__(*exc)

            def get_slice(self, key: str) -> _Slice:
                return _Slice(self.inner.get_slice(key), self.file)

            def get_tensor(self, key: str) -> torch.Tensor:
                return counter._count(self.inner.get_tensor(key), self.file)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        loader._open = lambda file, source: _Handle(self.original(file, source), str(file))

    def _count(self, tensor: torch.Tensor, file: str) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.files.add(file)
        self.bytes += nbytes
        self.largest = max(self.largest, nbytes)
        return tensor

    def close(self) -> None:
        loader._open = self.original

    def summary(self, module: torch.nn.Module, file_element_size: int = 4) -> dict[str, int]:
        """Bytes read, the largest read, the files read from, and this rank's own share: the local parts of its
        state-dict tensors (one per storage), in the files' element size."""
        from torch.distributed.tensor import DTensor

        seen, share = set(), 0
        for value in module.state_dict().values():
            local = value.to_local() if isinstance(value, DTensor) else value
            key = (local.data_ptr(), tuple(local.shape))
            if key not in seen:
                seen.add(key)
                share += local.numel() * file_element_size
        return {"bytes": self.bytes, "largest": self.largest, "share": share, "files": len(self.files)}
