"""DeepSpeed checkpoints in: a ZeRO-1/2/3 checkpoint written by a DeepSpeed engine (``engine.save_checkpoint``) or by
Lightning's ``DeepSpeedStrategy`` (its ``checkpoint/`` folder of ``zero_pp_rank_*`` files) becomes a lightning-hybrid
checkpoint, which then loads into any tensor/pipeline/data layout.

DeepSpeed's own readers do the reading:

* ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` gives the full fp32 weights (the master
  copy ZeRO keeps, merged over the data-parallel partitions);
* ``deepspeed.checkpoint.ds_to_universal`` (DeepSpeed's universal checkpoint) gives each parameter's full optimizer
  state: Adam's ``exp_avg`` and ``exp_avg_sq`` and its step count.

What is written: the weights as the model's ``state_dict``, the fp32 weights as the optimizer's master copy, the Adam
moments and step per parameter (``optimizer_0``), and, from a Lightning checkpoint, Lightning's own entries (loops,
epoch, callbacks, LR schedulers). The optimizer's hyper-parameters (lr, betas, weight decay) are not taken from the
DeepSpeed checkpoint: they are the ones ``configure_optimizers`` sets (DeepSpeed's parameter groups need not match the
module's). A raw engine's checkpoint has no Lightning loop state, so ``Trainer.fit`` starts counting steps from 0.

Example:
    >>> # lightning-hybrid convert deepspeed ds_checkpoints/ converted.ckpt
    >>> # trainer.fit(model, ckpt_path="ds_checkpoints/")   # converted on the fly, then loaded
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hybrid.checkpoint.format import META_FILENAME, CheckpointError, staging_path

__all__ = ["convert_deepspeed_checkpoint", "deepspeed_tag_folder", "imported", "main", "read_deepspeed_checkpoint"]

EXTRA = 'pip install "lightning-hybrid[deepspeed]"'
_MODEL_STATES = "model_states.pt"
# what a DeepSpeed engine writes into its model-state file besides the client state (Lightning's entries)
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info", "sparse_tensor_module_names", "mp_rank",
}  # fmt: skip
_MODULE_PREFIXES = ("_forward_module.", "module.")


def _import_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        raise CheckpointError(
            f"Reading a DeepSpeed checkpoint needs DeepSpeed ({error}). Install the extra: {EXTRA}."
        ) from None


def deepspeed_tag_folder(path: Any) -> Optional[Path]:
    """The folder of ``path`` that holds a DeepSpeed checkpoint's ``*model_states.pt`` files, or None when ``path`` is
    not a DeepSpeed checkpoint: ``path`` itself, or the tag its ``latest`` file names (a raw engine's save folder, or
    Lightning's ``DeepSpeedStrategy`` checkpoint, whose tag is ``checkpoint``)."""
    path = Path(path)
    if not path.is_dir():
        return None
    if any(path.glob(f"*{_MODEL_STATES}")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if tag.is_dir() and any(tag.glob(f"*{_MODEL_STATES}")):
            return tag
    return None


def _model_state_file(folder: Path) -> Path:
    files = sorted(folder.glob(f"*{_MODEL_STATES}"))
    first = [f for f in files if f.name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")]
    return (first or files)[0]


def _strip(name: str, known: Optional[set[str]]) -> str:
    if known is None or name in known:
        return name
    for prefix in _MODULE_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :] in known:
            return name[len(prefix) :]
    return name


def _universal(folder: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` conversion of ``folder`` into ``out`` (one process, its output hidden)."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(folder),
        output_folder=str(out),
        num_extract_workers=1,  # no worker processes: this may run inside a training process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # a raw engine's checkpoint lacks the info block Megatron-DeepSpeed adds
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)


def _load_fragment(file: Path) -> Optional[Tensor]:
    if not file.is_file():
        return None
    value = torch.load(file, map_location="cpu", weights_only=False)
    if isinstance(value, dict):  # ZeRO-1/2: {"param": tensor, "cat_dim": ...}
        value = value.get("param")
    return value


def read_deepspeed_checkpoint(path: Any, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """Read a DeepSpeed ZeRO-1/2/3 checkpoint into full tensors, with DeepSpeed's readers.

    ``names``: the target module's parameter and buffer names, to drop a wrapper's prefix from DeepSpeed's names.
    Returns ``{"weights": {name: fp32}, "state": {name: {"exp_avg", "exp_avg_sq", "step"}}, "meta": {...}}``,
    ``meta`` holding Lightning's entries when a Lightning ``DeepSpeedStrategy`` wrote it.

    Example:
        >>> # read_deepspeed_checkpoint("ds_checkpoints/")["weights"]["model.lm_head.weight"].shape
    """
    _import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = deepspeed_tag_folder(path)
    if folder is None:
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint (no *{_MODEL_STATES} files, no `latest` tag).")
    known = set(names) if names is not None else None
    with contextlib.redirect_stdout(io.StringIO()):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    weights = {_strip(k, known): v.detach().float() if v.is_floating_point() else v for k, v in fp32.items()}
    engine = torch.load(_model_state_file(folder), map_location="cpu", weights_only=False)
    shapes: dict[str, torch.Size] = {}
    for group in engine.get("param_shapes") or []:
        shapes.update(group)
    state: dict[str, dict[str, Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="lightning-hybrid-universal-") as tmp:
        _universal(folder, Path(tmp))
        zero = Path(tmp) / "zero"
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
        group_step = _group_step(common, engine)
        for name, shape in shapes.items():
            entries: dict[str, Tensor] = {}
            for stat in ("exp_avg", "exp_avg_sq"):
                value = _load_fragment(zero / name / f"{stat}.pt")
                if value is None:
                    break
                entries[stat] = value.float().reshape(shape)
            else:
                step = _load_fragment(zero / name / "step.pt")
                entries["step"] = torch.tensor(float(step if step is not None else group_step))
                state[_strip(name, known)] = entries
    meta = {k: v for k, v in engine.items() if k not in _ENGINE_KEYS}
    meta.setdefault("global_step", int(engine.get("global_steps", 0)))
    meta.setdefault("epoch", 0)
    return {"weights": weights, "state": state, "meta": meta}


def _group_step(common: dict[str, Any], engine: dict[str, Any]) -> float:
    """The optimizer's step count where DeepSpeed keeps one per group (ZeRO-3), else the engine's global steps."""
    inner = common.get("optimizer_state_dict")
    if isinstance(inner, dict):
        for entry in (inner.get("state") or {}).values():
            if isinstance(entry, dict) and "step" in entry:
                return float(entry["step"])
    return float(engine.get("global_steps", 0))


def convert_deepspeed_checkpoint(src: Any, dst: Any, names: Optional[Iterable[str]] = None) -> Path:
    """Write the DeepSpeed checkpoint ``src`` as a lightning-hybrid checkpoint directory ``dst`` (one process, no
    process group needed; written to a staging folder and renamed when complete).

    Example:
        >>> # convert_deepspeed_checkpoint("ds_checkpoints/", "converted.ckpt")
        >>> # trainer.fit(model, ckpt_path="converted.ckpt")   # any HybridStrategy layout
    """
    import lightning
    import torch.distributed.checkpoint as dcp

    from lightning_hybrid.checkpoint.consolidate import natural_shape_entries
    from lightning_hybrid.checkpoint.integrity import file_digest, write_commit_record
    from lightning_hybrid.checkpoint.io import OPTIMIZER_HYPERPARAMETERS_KEY, VERSIONS_KEY, flatten_state
    from lightning_hybrid.checkpoint.tensors import dcp_ready

    read = read_deepspeed_checkpoint(src, names)
    weights, state = read["weights"], read["state"]
    optimizer_state = {"state": state, "master": {n: weights[n] for n in state if n in weights}}
    meta = dict(read["meta"])
    meta.setdefault("pytorch-lightning_version", lightning.__version__)
    meta.setdefault("lr_schedulers", [])  # a raw engine's scheduler is not Lightning's: the module's starts afresh
    # one optimizer; its hyper-parameters are configure_optimizers' own (an empty list per optimizer keeps them)
    meta[OPTIMIZER_HYPERPARAMETERS_KEY] = [[]]
    meta[VERSIONS_KEY] = {"torch": str(torch.__version__), "lightning": lightning.__version__}
    meta["deepspeed_source"] = str(Path(src))
    flat = flatten_state(weights, [optimizer_state])
    flat.update(natural_shape_entries(flat))
    flat = dcp_ready(flat)
    dst = Path(dst)
    staging = staging_path(dst)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.save(meta, staging / META_FILENAME)
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=True)
    # the commit record last, as every save writes it: loads check each file against it
    files = {f.name: list(file_digest(f)) for f in sorted(staging.iterdir()) if f.is_file()}
    write_commit_record(staging, files)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(staging, dst)
    return dst


@contextlib.contextmanager
def imported(
    path: Path,
    names: Iterable[str],
    *,
    converts: bool,
    barrier: Callable[[], None],
    token: str,
) -> Generator[Path, None, None]:
    """``path`` as a lightning-hybrid checkpoint: itself, or, for a DeepSpeed checkpoint, a converted copy in a
    temporary folder that one process per node (``converts``) writes and removes afterwards. Collective when ``path``
    is a DeepSpeed checkpoint: every rank calls it (``token``: the same string on every rank, e.g. broadcast)."""
    if deepspeed_tag_folder(path) is None:
        yield path
        return
    target = Path(tempfile.gettempdir()) / f"lightning-hybrid-deepspeed-{token}" / "converted.ckpt"
    error: Optional[BaseException] = None
    if converts:
        try:
            convert_deepspeed_checkpoint(path, target, names)
        except BaseException as e:  # raised after the barrier, so the other ranks do not wait for a file forever
            error = e
    barrier()
    if error is not None:
        raise error
    try:
        yield target
    finally:
        barrier()
        if converts:
            shutil.rmtree(target.parent, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> Path:
    """``lightning-hybrid convert deepspeed SRC DST``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-hybrid convert deepspeed",
        description="Write a DeepSpeed ZeRO-1/2/3 checkpoint (a DeepSpeed engine's save folder, or a Lightning"
        " DeepSpeedStrategy checkpoint) as a lightning-hybrid checkpoint: weights, fp32 master weights and Adam state,"
        " loadable into any HybridStrategy layout with Trainer.fit(ckpt_path=DST).",
    )
    parser.add_argument("source", help="the DeepSpeed checkpoint folder (holding `latest`, or the tag folder itself)")
    parser.add_argument("output", help="the lightning-hybrid checkpoint directory to write (e.g. converted.ckpt)")
    options = parser.parse_args(argv)
    out = convert_deepspeed_checkpoint(options.source, options.output)
    print(f"wrote {out}")
    return out
