"""Process groups over a subset of the ranks, made once per process and reused by later fits.

A leaf below the mechanisms that need such groups (the pipeline's tied-weight holders): the mesh and the default group
are started by ``topology.py``, which sits above them, with Lightning.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch.distributed as dist

__all__ = ["forget_subgroups", "subgroup"]


def subgroup(ranks: list[int]) -> Any:
    """``dist.new_group(ranks)``, made once per process and reused by later fits, as the meshes are (each new group
    keeps its threads until exit). Collective like ``new_group``: every rank calls it with the same ranks in the same
    order, and gets the same answer, made or reused: a group is reused while the default group it was made under
    lives (a script that destroyed the groups and initialized again gets new ones on every rank).

    Example:
        >>> # holders = subgroup([0, 3])  # the pipeline ranks that hold a tied weight
    """
    world = dist.group.WORLD
    key = (tuple(ranks), dist.get_backend())
    cached = _SUBGROUPS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    group = dist.new_group(list(ranks))
    _SUBGROUPS[key] = (world, group)
    return group


_SUBGROUPS: dict[tuple, tuple[Any, Any]] = {}  # (ranks, backend) -> (the default group then, the group)
atexit.register(_SUBGROUPS.clear)


def forget_subgroups() -> None:
    """Drop the groups kept for reuse (at exit, once every group is destroyed), so none is freed in finalization."""
    _SUBGROUPS.clear()
