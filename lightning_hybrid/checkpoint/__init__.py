"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes only what it holds.

A checkpoint is a directory: DCP's shard files and ``.metadata`` for the model and optimizer tensors, plus
``meta.pt`` (rank 0) with the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters) and the
layout it was saved with. Model weights are saved by fully qualified name as DTensors where they are sharded, so DCP
can load them into another tensor/pipeline/ZeRO-3 layout. ZeRO-1/2 optimizer state is saved as this layout's flat
shards and loads into the same layout only (the loader says so when the layout differs).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_hybrid.config import HybridConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_hybrid.sharding import ShardedOptimizer

__all__ = ["LAYOUT_KEY", "META_FILENAME", "load_sharded", "optimizer_state", "save_sharded"]

META_FILENAME = "meta.pt"
LAYOUT_KEY = "hybrid_layout"


def _is_strided(placement: Any) -> bool:
    return type(placement).__name__ == "_StridedShard"


def _unstrided(t: DTensor) -> DTensor:
    """A fused projection's DTensor (``_StridedShard(0, k)`` over tensor ranks, which DCP cannot lay out) as the
    same storage viewed ``[k, rows/k, ...]`` with a plain ``Shard(1)``: each rank's rows are one contiguous slab per
    block in that view, so DCP saves, loads and reshards it like any sharded tensor."""
    index = next(i for i, p in enumerate(t.placements) if _is_strided(p))
    k = t.placements[index].split_factor
    local = t.to_local()
    placements = []
    for i, p in enumerate(t.placements):
        if i == index:
            placements.append(Shard(1))
        elif p.is_shard():
            placements.append(Shard(p.dim + 1))  # a later dimension shifts by the added block dimension
        else:
            placements.append(p)
    shape = (k, t.shape[0] // k, *t.shape[1:])
    view = local.view(k, local.shape[0] // k, *local.shape[1:])
    return DTensor.from_local(view, t.device_mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def dcp_ready(tree: Any) -> Any:
    """``tree`` with every strided (fused-projection) DTensor replaced by its DCP-friendly view; the views share
    storage with the originals, so a DCP load into the result fills the originals in place."""
    if isinstance(tree, DTensor):
        return _unstrided(tree) if any(_is_strided(p) for p in tree.placements) else tree
    if isinstance(tree, dict):
        return {k: dcp_ready(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [dcp_ready(v) for v in tree]
    return tree


def _flat_state(zero: ShardedOptimizer, coordinates: str, dp_mesh: DeviceMesh) -> dict[str, Any]:
    """The ZeRO-1/2 optimizer's flat shards as DTensors over the data dimension (one key per pipeline/tensor
    coordinate, since each holds a different flat), and its hyper-parameters."""
    out: dict[str, Any] = {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups]
    }
    for index, group in enumerate(zero.groups):
        if group.master is None:
            continue
        global_shape = (group.shard_size * zero.dp,)
        tensors = {"master": group.master.data, **zero.optimizer.state.get(group.master, {})}
        for name, value in tensors.items():
            key = f"group{index}.{coordinates}.{name}"
            if isinstance(value, Tensor) and value.dim() > 0:
                out[key] = DTensor.from_local(
                    value, dp_mesh, [Shard(0)], run_check=False, shape=global_shape, stride=(1,)
                )
            else:
                out[key] = value
    return out


def _ensure_state(zero: ShardedOptimizer) -> None:
    """Create the optimizer's lazily made state (one step with zero gradients and learning rate 0), so that a load
    has tensors to write into; torch's own state_dict helpers do the same for regular optimizers."""
    if all(g.master is None or g.master in zero.optimizer.state for g in zero.groups):
        return
    lrs = [g["lr"] for g in zero.optimizer.param_groups]
    for group in zero.groups:
        if group.master is not None:
            group.master.grad = torch.zeros_like(group.master)
    for g in zero.optimizer.param_groups:
        g["lr"] = 0.0
    zero.optimizer.step()
    for g, lr in zip(zero.optimizer.param_groups, lrs):
        g["lr"] = lr
    for group in zero.groups:
        if group.master is not None:
            group.master.grad = None


def optimizer_state(
    module: nn.Module, optimizer: Optimizer, zero: Optional[ShardedOptimizer], coordinates: str, dp_mesh: DeviceMesh
) -> dict[str, Any]:
    """The optimizer's state in a form DCP saves shard by shard (FQN-keyed for stage 0/3, flat shards for 1/2)."""
    if zero is not None and zero.stage > 0:
        return _flat_state(zero, coordinates, dp_mesh)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = dict(get_optimizer_state_dict(module, optimizer))
    # param_groups list each group's parameter names, which differ between pipeline stages; DCP keeps one copy of a
    # non-tensor entry, so each coordinate gets its own key
    state[f"param_groups.{coordinates}"] = state.pop("param_groups")
    return state


def save_sharded(path: Path, state: dict[str, Any], meta: dict[str, Any], is_rank_zero: bool) -> None:
    """Every rank writes its shards of ``state``; rank 0 writes ``meta``."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True, exist_ok=True)
    dcp.save(dcp_ready(state), checkpoint_id=str(path))
    if is_rank_zero:
        torch.save(meta, path / META_FILENAME)


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    zeros: list[Optional[ShardedOptimizer]],
    coordinates: str,
    dp_mesh: DeviceMesh,
    layout: dict[str, Any],
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint made by :func:`save_sharded` in place; returns the rest of Lightning's checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not (path / META_FILENAME).is_file() or not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete lightning-hybrid checkpoint: it needs `{META_FILENAME}` and DCP's `.metadata`."
        )
    meta = torch.load(path / META_FILENAME, weights_only=False)
    saved_layout = meta.get(LAYOUT_KEY, {})
    state: dict[str, Any] = {"state_dict": module.state_dict()}
    flat_optimizers = [z for z in zeros if z is not None and z.stage > 0]
    if flat_optimizers and optimizers:
        keys = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "zero_stage")
        changed = {k: (saved_layout.get(k), layout.get(k)) for k in keys if saved_layout.get(k) != layout.get(k)}
        if changed or saved_layout.get("pipeline_partition") != layout.get("pipeline_partition"):
            raise HybridConfigError(
                f"{path} was saved with another layout ({changed or 'pipeline partition'}); loading ZeRO-1/2 optimizer"
                " state into a different layout is not supported yet. Resume with the saved layout, or load the"
                " weights only (`trainer.fit(model)` after `model.load_state_dict(...)` from a consolidated file)."
            )
    for index, (optimizer, zero) in enumerate(zip(optimizers, zeros)):
        if zero is not None and zero.stage > 0:
            _ensure_state(zero)
        state[f"optimizer_{index}"] = optimizer_state(module, optimizer, zero, coordinates, dp_mesh)
    # DCP loads in place: into the parameters' and optimizer state's own storage (through dcp_ready's views)
    ready = dcp_ready(state)
    dcp.load(ready, checkpoint_id=str(path))
    _take_loaded_values(ready, state)  # DCP replaces non-tensor entries (hyper-parameters) in the dict it was given
    module.load_state_dict(state["state_dict"], strict=strict)
    for index, (optimizer, zero) in enumerate(zip(optimizers, zeros)):
        loaded = state[f"optimizer_{index}"]
        if zero is not None and zero.stage > 0:
            for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
                group.update(saved)
            _restore_scalars(zero, loaded, coordinates)
        else:
            loaded = dict(loaded)
            loaded["param_groups"] = loaded.pop(f"param_groups.{coordinates}")
            set_optimizer_state_dict(module, optimizer, loaded)
    return {k: v for k, v in meta.items() if k != LAYOUT_KEY}


def _take_loaded_values(loaded: Any, target: Any) -> None:
    """Copy the non-tensor leaves DCP loaded (hyper-parameters, counters) into ``target``, keeping its structure."""
    items = loaded.items() if isinstance(loaded, dict) else enumerate(loaded)
    for key, value in items:
        if isinstance(target, list):
            index = int(key)
            if index >= len(target):
                continue
            current = target[index]
        elif isinstance(target, dict) and key in target:
            current = target[key]
        else:
            continue
        if isinstance(current, (dict, list)) and isinstance(value, (dict, list)):
            _take_loaded_values(value, current)
        elif not isinstance(current, Tensor) and not isinstance(value, (dict, list, Tensor)):
            target[key if not isinstance(target, list) else int(key)] = value
        elif isinstance(current, tuple) and isinstance(value, (list, tuple)):
            target[key] = tuple(value)


def _restore_scalars(zero: ShardedOptimizer, loaded: dict[str, Any], coordinates: str) -> None:
    # tensors were loaded in place (the DTensors wrap the live state); scalar entries such as Adam's step are copied
    for index, group in enumerate(zero.groups):
        if group.master is None:
            continue
        state = zero.optimizer.state[group.master]
        for name, value in list(state.items()):
            key = f"group{index}.{coordinates}.{name}"
            if isinstance(value, Tensor) and value.dim() == 0 and key in loaded:
                value.copy_(loaded[key])
            elif not isinstance(value, Tensor) and key in loaded:
                state[name] = loaded[key]
