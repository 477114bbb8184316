"""Optimizer state in one layout-free form: per parameter, keyed by its name, laid out like the parameter.

Saved as ``optimizer_<i>.state.<param name>.<stat>`` (``exp_avg``, ``step``, ...) and, for ZeRO-1/2,
``optimizer_<i>.master.<param name>`` (the optimizer's own copy of the weight). This is what torch's
``get_optimizer_state_dict`` gives for ZeRO-0 and ZeRO-3 (FSDP2), and what a ZeRO-1/2 flat shard is turned into, so a
checkpoint loads under any tensor/pipeline/data layout and ZeRO stage: DCP cuts each tensor for its new owners.

ZeRO-1/2 on save: parameter ``p`` covers the range ``[a, b)`` of its (pipeline, tensor) coordinate's flat buffer,
which the data-parallel ranks hold in equal shards. The rank holding most of the range writes ``p``'s state; the
others send it their pieces (a parameter lying inside one shard, the usual case, needs no message and no copy). So a
rank's extra memory is at most the parameters straddling its shard's two ends. On load, each rank reads the
parameters its shard overlaps (its own tensor-parallel slices) and cuts its range out of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid.dtensor import like, local_tensor
from lightning_hybrid.structure import state_dict_name

if TYPE_CHECKING:
    from lightning_hybrid.sharding.flat import FlatGroup
    from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

__all__ = ["HYPERPARAMETERS_KEY", "optimizer_load_targets", "optimizer_state"]

HYPERPARAMETERS_KEY = "param_groups"


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): state_dict_name(n) for n, p in module.named_parameters()}


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _is_vector(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def _ranges(group: Any) -> list[tuple[nn.Parameter, int, int]]:
    out, offset = [], 0
    for p in group.params:
        n = local_tensor(p).numel()
        out.append((p, offset, offset + n))
        offset += n
    return out


def _pieces(a: int, b: int, shard: int, dp: int) -> list[tuple[int, int, int]]:
    """(data rank, start, stop) of every shard that holds part of ``[a, b)``."""
    return [
        (q, max(a, q * shard), min(b, (q + 1) * shard))
        for q in range(dp)
        if max(a, q * shard) < min(b, (q + 1) * shard)
    ]


def _owner(pieces: list[tuple[int, int, int]]) -> int:
    return max(pieces, key=lambda piece: (piece[2] - piece[1], -piece[0]))[0]


def _geometry(zero: ShardedOptimizer, group: FlatGroup) -> tuple[int, int]:
    """(this rank's shard index, number of shards) of ``group``'s flat buffer over its ranks (all data-parallel ranks,
    or under expert parallel those holding the same experts): (0, 1) when not sharded (stage 0 with master weights
    keeps whole copies on every replica)."""
    return (group.ranks.rank, group.ranks.size) if getattr(zero, "sharded", zero.stage >= 1) else (0, 1)


def uses_flat_state(zero: Optional[ShardedOptimizer]) -> bool:
    """Whether the optimizer steps flat master buffers (ZeRO-1/2, or master weights) instead of the parameters."""
    return zero is not None and any(g.master is not None for g in zero.groups)


def _zero_state(module: nn.Module, zero: ShardedOptimizer) -> dict[str, Any]:
    names = _names(module)
    state: dict[str, dict[str, Any]] = {}
    master: dict[str, Tensor] = {}
    for group in zero.groups:
        if group.master is None:
            continue
        rank, dp = _geometry(zero, group)
        ranks = group.ranks.group
        flat_state = zero.optimizer.state.get(group.master, {})
        vectors = {"master": group.master.detach(), **{k: v for k, v in flat_state.items() if _is_vector(v)}}
        scalars = {k: v for k, v in flat_state.items() if not _is_vector(v)}
        base = rank * group.shard_size
        for p, a, b in _ranges(group):
            pieces = _pieces(a, b, group.shard_size, dp)
            owner = _owner(pieces)
            mine = next(((lo, hi) for q, lo, hi in pieces if q == rank), None)
            if owner != rank:
                if mine is not None:  # send my piece of every vector to the owner
                    dst = dist.get_global_rank(ranks, owner)  # dp > 1 here: the flat buffers are sharded
                    for v in vectors.values():
                        dist.send(v[mine[0] - base : mine[1] - base].contiguous(), dst, group=ranks)
                continue
            gathered: dict[str, Tensor] = {}
            for stat, v in vectors.items():
                if len(pieces) == 1:
                    flat = v[a - base : b - base]  # a view: nothing copied
                else:
                    flat = v.new_empty(b - a)
                    for q, lo, hi in pieces:
                        if q == rank:
                            flat[lo - a : hi - a] = v[lo - base : hi - base]
                        else:
                            dist.recv(flat[lo - a : hi - a], dist.get_global_rank(ranks, q), group=ranks)
                gathered[stat] = like(flat.view(local_tensor(p).shape), p)
            name = names[id(p)]
            master[name] = gathered.pop("master")
            state[name] = {**gathered, **scalars}
    return {"state": state, "master": master}


def optimizer_state(
    module: nn.Module, optimizer: Optimizer, zero: Optional[ShardedOptimizer], skip: Collection[str] = ()
) -> dict[str, Any]:
    """The optimizer's state in the layout-free form (collective under ZeRO-1/2: call it on every rank).

    Returns ``{"state": {name: {stat: tensor}}, "master": {name: tensor}, "param_groups": [hyper-parameters]}``,
    without the parameters named in ``skip`` (held here, but another pipeline stage owns and writes them).

    Example:
        >>> # state = optimizer_state(module, optimizer, strategy._sharded_for(optimizer))
    """
    if uses_flat_state(zero):
        out = _zero_state(module, zero)
    else:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out = {"state": dict(get_optimizer_state_dict(module, optimizer)["state"]), "master": {}}
    for part in ("state", "master"):
        out[part] = {name: value for name, value in out[part].items() if name not in skip}
    out[HYPERPARAMETERS_KEY] = _hyperparameters(optimizer)
    return out


def ensure_state(zero: ShardedOptimizer) -> None:
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


def _key(prefix: str, name: str, stat: str) -> str:
    return f"{prefix}.master.{name}" if stat == "master" else f"{prefix}.state.{name}.{stat}"


def _resolve(key_of: Callable[[str], str], name: str, available: set[str], aliases: dict[str, str]) -> Optional[str]:
    for candidate in (name, aliases.get(name)):
        if candidate is not None and key_of(candidate) in available:
            return key_of(candidate)
    return None


def optimizer_load_targets(
    module: nn.Module,
    optimizer: Optimizer,
    zero: Optional[ShardedOptimizer],
    prefix: str,
    available: set[str],
    aliases: dict[str, str],
) -> tuple[dict[str, Any], dict[str, str], list[str], Callable[[dict[str, Any], list[dict[str, Any]]], None]]:
    """Live tensors (or temporaries) for every checkpoint entry this rank's part of ``optimizer`` needs.

    Returns ``(targets, descriptions, missing, finish)``: ``finish(loaded, hyperparameters)`` installs what DCP read
    (cut ZeRO ranges, scalars, hyper-parameters). ``available`` is the set of keys in the checkpoint; ``aliases`` maps a
    tied weight's name to its partner's (a pipeline stage may hold the copy that a one-stage run saved under the other).
    """
    flat = uses_flat_state(zero)
    targets = (
        _zero_targets(module, zero, prefix, available, aliases)
        if flat
        else _torch_targets(module, optimizer, prefix, available, aliases)
    )
    if any(key.startswith(f"{prefix}.state.") for key in available):
        return targets
    # saved before this optimizer's first step (Lightning's tuner saves one to restore after its trial steps): no
    # state to load, and the optimizer is left as fresh as it was then, as torch's load_state_dict of an empty state
    chosen, describe, _, finish = targets
    inner = zero.optimizer if flat else optimizer

    def finish_fresh(loaded: dict[str, Any], hyperparameters: list[dict[str, Any]]) -> None:
        finish(loaded, hyperparameters)
        inner.state.clear()

    kept = {k: v for k, v in chosen.items() if not k.startswith(f"{prefix}.state.")}
    return kept, describe, [], finish_fresh


def _set_hyperparameters(optimizer: Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


def _zero_targets(
    module: nn.Module, zero: ShardedOptimizer, prefix: str, available: set[str], aliases: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str], list[str], Callable[[dict[str, Any], list[dict[str, Any]]], None]]:
    ensure_state(zero)
    names = _names(module)
    targets: dict[str, Any] = {}
    describe: dict[str, str] = {}
    missing: list[str] = []
    copies: list[tuple[Tensor, Tensor]] = []  # (destination in a flat shard, source) after the load
    scalar_reads: list[tuple[dict[str, Any], str, str]] = []  # (optimizer state, stat, checkpoint key)
    rebuild: list[tuple[Tensor, nn.Parameter, int, int]] = []  # master ranges to take from the loaded weights
    for group in zero.groups:
        if group.master is None:
            continue
        rank, _ = _geometry(zero, group)
        flat_state = zero.optimizer.state[group.master]
        vectors = {"master": group.master.data, **{k: v for k, v in flat_state.items() if _is_vector(v)}}
        base, stop = rank * group.shard_size, (rank + 1) * group.shard_size
        first_name: Optional[str] = None
        for p, a, b in _ranges(group):
            lo, hi = max(a, base), min(b, stop)
            if lo >= hi:
                continue
            name = names[id(p)]
            first_name = first_name or name
            for stat, v in vectors.items():
                key = _resolve(lambda n, s=stat: _key(prefix, n, s), name, available, aliases)
                if key is None:
                    if stat == "master":  # saved without a master copy (ZeRO-0/3): the weights are the master
                        rebuild.append((v[lo - base : hi - base], p, lo - a, hi - a))
                    else:
                        missing.append(f"optimizer state `{stat}` of parameter `{name}`")
                    continue
                shape = local_tensor(p).shape
                if (lo, hi) == (a, b):
                    targets[key] = like(v[lo - base : hi - base].view(shape), p)  # in place
                else:
                    temporary = v.new_empty(shape)
                    targets[key] = like(temporary, p)
                    copies.append((v[lo - base : hi - base], temporary.view(-1)[lo - a : hi - a]))
                describe[key] = f"`{stat}` of parameter `{name}` ({prefix})"
        for stat, value in flat_state.items():
            if _is_vector(value) or first_name is None:
                continue
            key = _resolve(lambda n, s=stat: _key(prefix, n, s), first_name, available, aliases)
            if key is None:
                missing.append(f"optimizer state `{stat}` of parameter `{first_name}`")
                continue
            targets[key] = value.clone() if isinstance(value, Tensor) else value
            scalar_reads.append((flat_state, stat, key))

    @torch.no_grad()
    def finish(loaded: dict[str, Any], hyperparameters: list[dict[str, Any]]) -> None:
        for destination, source in copies:
            destination.copy_(source)
        for destination, p, lo, hi in rebuild:
            destination.copy_(local_tensor(p).reshape(-1)[lo:hi])
        for state, stat, key in scalar_reads:
            value = loaded[key]
            if isinstance(state[stat], Tensor):
                state[stat].copy_(value)
            else:
                state[stat] = value
        _set_hyperparameters(zero.optimizer, hyperparameters)

    return targets, describe, missing, finish


def _torch_targets(
    module: nn.Module, optimizer: Optimizer, prefix: str, available: set[str], aliases: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str], list[str], Callable[[dict[str, Any], list[dict[str, Any]]], None]]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    current = get_optimizer_state_dict(module, optimizer)  # creates the lazily made state
    targets: dict[str, Any] = {}
    describe: dict[str, str] = {}
    missing: list[str] = []
    where: dict[str, tuple[str, str]] = {}
    for name, entries in current["state"].items():
        for stat, value in entries.items():
            key = _resolve(lambda n, s=stat: _key(prefix, n, s), name, available, aliases)
            if key is None:
                missing.append(f"optimizer state `{stat}` of parameter `{name}`")
                continue
            targets[key] = value
            describe[key] = f"`{stat}` of parameter `{name}` ({prefix})"
            where[key] = (name, stat)

    def finish(loaded: dict[str, Any], hyperparameters: list[dict[str, Any]]) -> None:
        state = {name: dict(entries) for name, entries in current["state"].items()}
        for key, (name, stat) in where.items():
            if not isinstance(state[name][stat], Tensor):
                state[name][stat] = loaded[key]
        groups = [dict(g) for g in current["param_groups"]]
        for group, values in zip(groups, hyperparameters):
            group.update(values)
        set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups})

    return targets, describe, missing, finish
