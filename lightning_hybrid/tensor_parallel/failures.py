"""A forward that fails under a tensor-parallel plan, explained: which split module it failed in, and the plan to give.

A plan can look right by its layers and still not fit the forward: Falcon's multi-query ``query_key_value`` holds
n_head query heads but one key and one value head (a column-wise split cuts them apart), BLOOM adds ALiBi slopes that
its model computes for all heads outside the blocks. Such a forward fails with a shape error inside the split module
on every tensor-parallel rank alike (the ranks compute the same shapes), before any optimizer step; this turns it
into a :class:`~lightning_hybrid.HybridConfigError` that names the module and prints the plan without it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.tensor_parallel.plan import TensorParallelPlan

__all__ = ["explain_forward_failure"]

_IN_PLACE_ON_VIEW = "is a view and is being modified inplace"
"""Part of autograd's error for an in-place op on the output of a custom autograd function that returns a view."""


def _failing_modules(error: BaseException, root: nn.Module) -> list[str]:
    """Names of the modules of ``root`` whose frames the traceback passes through, innermost first."""
    names = {id(m): n for n, m in root.named_modules()}
    found: list[str] = []
    tb: Optional[TracebackType] = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names and names[id(owner)] not in found:
            found.append(names[id(owner)])
        tb = tb.tb_next
    return found[::-1]


def _split_under(plan: TensorParallelPlan, name: str) -> list[str]:
    prefix = f"{name}." if name else ""
    return [n for n in plan.styles if n == name or n.startswith(prefix)]


def explain_forward_failure(
    error: BaseException,
    root: nn.Module,
    plan: TensorParallelPlan,
    tensor_parallel_size: int,
) -> Optional[HybridConfigError]:
    """The configuration error for ``error``, raised by a forward of ``root`` under ``plan``; None when the failure
    is not inside a module the plan splits (then it is the user's own, raised as it is).

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> net = nn.Sequential(nn.Linear(8, 8))
        >>> plan = TensorParallelPlan()
        >>> plan.styles["0"] = ColwiseParallel()
        >>> try:
        ...     net(torch.zeros(2, 4))  # a shape error inside the split layer
        ... except RuntimeError as error:
        ...     print(type(explain_forward_failure(error, net, plan, 2)).__name__)
        HybridConfigError
    """
    if not isinstance(error, (RuntimeError, ValueError, IndexError)) or isinstance(error, torch.OutOfMemoryError):
        return None
    for name in _failing_modules(error, root):
        split = _split_under(plan, name)
        if not split:
            continue
        label = name or type(root).__name__
        kept = {n: _style_name(s) for n, s in plan.styles.items() if n not in split}
        shown = ", ".join(f"{n}: {_style_name(plan.styles[n])}" for n in split[:4]) + (" ..." if len(split) > 4 else "")
        if _IN_PLACE_ON_VIEW in str(error):
            # torch's split layers hand their local output on as a view made by an autograd function (DTensor's
            # to_local), which autograd forbids modifying in place: the forward's own `x += y` on it (Falcon's
            # parallel attention adds the attention's output into the MLP's), not the sizes, is the cause
            return HybridConfigError(
                f"`tensor_parallel_size={tensor_parallel_size}`: the forward failed in `{label}`"
                f" ({type(root.get_submodule(name)).__name__}), which the tensor-parallel plan splits ({shown}), with"
                f" {type(error).__name__}: {error} Its forward modifies the output of a split layer in place (`x +="
                " y`), which a tensor-parallel layer's output (a view made by DTensor's `to_local`) cannot take."
                " Leave the layers whose output it modifies replicated: pass `tensor_parallel_plan` as a dict without"
                f" them (the plan found, less the module's: {_short(kept)}), or train this model with data or"
                " pipeline parallel."
            )
        return HybridConfigError(
            f"`tensor_parallel_size={tensor_parallel_size}`: the forward failed in `{label}`"
            f" ({type(root.get_submodule(name)).__name__}), which the tensor-parallel plan splits ({shown}), with"
            f" {type(error).__name__}: {error}. The module computes with sizes the plan cannot see from its layers:"
            " a fused q|k|v of unequal parts (multi-query or grouped-query attention), head counts read from"
            " elsewhere, or a per-head tensor built outside the block (ALiBi slopes). Leave it replicated: pass"
            " `tensor_parallel_plan` as a dict without its layers (the plan found, less them:"
            f" {_short(kept)}), or train this model with data or pipeline parallel."
        )
    return None


def _style_name(style: object) -> str:
    # the names a dict plan takes for torch's two plain styles; other styles by their class
    return {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise"}.get(type(style).__name__, type(style).__name__)


def _short(plan: dict[str, str], limit: int = 6) -> str:
    items = list(plan.items())
    text = ", ".join(f"{n!r}: {s!r}" for n, s in items[:limit])
    return "{" + text + (", ..." if len(items) > limit else "") + "}"
