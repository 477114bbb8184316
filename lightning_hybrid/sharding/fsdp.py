"""ZeRO-3 over the data-parallel dimension: FSDP2 (``fully_shard``) applied to each block and root, which composes
with DTensor tensor parallel and with ``torch.distributed.pipelining``; and the refusal of layouts that clash with a
``fully_shard`` the user's ``configure_model`` applied itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._torch_compat import is_strided_shard
from lightning_hybrid.config import HybridConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_fully_shard", "check_user_sharding", "user_fully_sharded"]


def _strided(p: nn.Parameter) -> bool:
    return isinstance(p, DTensor) and any(is_strided_shard(pl) for pl in p.placements)


def apply_fully_shard(
    module: nn.Module,
    block_names: list[str],
    roots: Optional[list[str]],
    dp_mesh: DeviceMesh,
    *,
    user_sharded: Optional[bool] = None,
    **kwargs: Any,
) -> list[str]:
    """ZeRO-3: FSDP2 ``fully_shard`` each transformer block, then each root (the rest of the parameters), innermost
    first (``ModelStructure.fully_shard_roots``). ``roots=None``: the caller wraps what the blocks leave itself (each
    pipeline stage module).

    Parameters are gathered before each block's forward/backward and freed after (``reshard_after_forward``).
    Returns the names of parameters left out of FSDP2 (fused tensor-parallel biases and, given ``roots``, those
    outside every block and root), which stay replicated: the caller must average their gradients over ``dp_mesh``.
    ``user_sharded``: whether the user's ``configure_model`` applied ``fully_shard`` (asked here when None; a caller
    that made units of its own first, the experts' under expert parallel, asks before).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if user_fully_sharded(module) if user_sharded is None else user_sharded:
        # the LightningModule's configure_model applied fully_shard itself (as written for Lightning's
        # ModelParallelStrategy): a second one would fail or shard twice; what its units leave out stays replicated
        return [n for n, p in module.named_parameters() if not _sharded_over(p, dp_mesh)]

    # A fused projection split by tensor parallel (_StridedShard on its fused dim) composes wrongly with FSDP2's own
    # split of that same dim (full_tensor() and checkpoints would see permuted rows): shard such weights on their
    # first other dim instead (dim 1 of a fused q|k|v weight, the expert dim of packed MoE experts), and leave 1-D ones
    # (fused biases, tiny) replicated over the data dimension.
    ignored = {p for p in module.parameters() if _strided(p) and p.dim() < 2}

    def placement(p: nn.Parameter) -> Optional[Shard]:
        if not _strided(p):
            return None
        fused = {pl.dim % p.dim() for pl in p.placements if is_strided_shard(pl)}
        return Shard(next(d for d in range(p.dim()) if d not in fused))

    covered: set[nn.Parameter] = set()
    for name in [*block_names, *(roots or [])]:
        target = module.get_submodule(name) if name else module
        fully_shard(target, mesh=dp_mesh, shard_placement_fn=placement, ignored_params=ignored, **kwargs)
        covered.update(target.parameters())
    left_out = ignored if roots is None else ignored | (set(module.parameters()) - covered)
    return [n for n, p in module.named_parameters() if p in left_out]


def user_fully_sharded(module: nn.Module) -> bool:
    """Whether ``module`` already holds FSDP2 units (``fully_shard`` applied in the user's ``configure_model``).

    Example:
        >>> user_fully_sharded(nn.Linear(2, 2))
        False
    """
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _sharded_over(p: nn.Parameter, dp_mesh: DeviceMesh) -> bool:
    """A parameter an FSDP2 unit shards over the data-parallel dimension: a DTensor on a mesh with that dimension."""
    from torch.distributed.tensor import DTensor

    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return any(name in names for name in dp_mesh.mesh_dim_names or ())


def check_user_sharding(module: nn.Module, zero_stage: int, pipeline_parallel_size: int = 1) -> None:
    """Refuse a ``zero_stage`` below 3 for a module whose ``configure_model`` applied ``fully_shard`` (that is
    ZeRO-3 already; a ZeRO-1/2 optimizer over FSDP2's shards would shard them again). Collective-free.

    Example:
        >>> check_user_sharding(nn.Linear(2, 2), zero_stage=1)
    """
    if pipeline_parallel_size > 1 and user_fully_sharded(module):
        # each pipeline stage is its own FSDP2 unit; the user's units span the whole model (a second fully_shard
        # over their DTensors fails: "Cannot concatenate overlapping meshes")
        raise HybridConfigError(
            f"`pipeline_parallel_size={pipeline_parallel_size}`, but the LightningModule's `configure_model` already"
            " applied FSDP2's `fully_shard` to the whole model; under pipeline parallel each stage is sharded on its"
            " own. Remove `fully_shard` from `configure_model` and pass `zero_stage=3` (HybridStrategy shards each"
            " stage), or use `pipeline_parallel_size=1`."
        )
    if zero_stage < 3 and user_fully_sharded(module):
        raise HybridConfigError(
            f"`zero_stage={zero_stage}`, but the LightningModule's `configure_model` already applied FSDP2's"
            " `fully_shard` (parameters sharded over the data-parallel dimension: ZeRO-3). Pass `zero_stage=3`, or"
            " leave the sharding to HybridStrategy and remove `fully_shard` from `configure_model`."
        )
