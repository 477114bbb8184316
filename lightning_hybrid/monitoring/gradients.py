"""Gradient norms a module logs in ``on_before_optimizer_step``, as ``"ddp"`` logs them, under every layout.

Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` reads ``p.grad`` of the parameters this rank
holds: under tensor parallel and ZeRO-3 those are DTensor shards, and it fails at the first step (``torch.tensor``
over DTensor norms: "The tensor has a non-zero number of elements, but its data is not allocated yet"); under ZeRO-1/2
the reduced gradients live in the optimizer's flat shards, ``p.grad`` is None and it returns nothing; under a pipeline
each stage would log its own parameters' norms and a total over them only. :func:`grad_norm` takes the same arguments
and returns the same dictionary, computed over the whole model: every gradient whole (gathered one parameter at a
time), every stage's names merged, the total over all of them. Under any other strategy it is Lightning's.

A module or callback that names Lightning's function is refused before training (:func:`check_gradient_norm_hooks`,
every rank alike: they run the same code) wherever that function would not log what ``"ddp"`` logs, naming this one as
the fix; one reached through code the check does not read fails at its first step under tensor parallel or ZeRO-3, and
that failure is raised as the same error (:func:`raised_in_lightning_grad_norm`).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any, Union

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn

from lightning_hybrid._lightning_compat import module_trainer
from lightning_hybrid.config import HybridConfigError

__all__ = ["check_gradient_norm_hooks", "grad_norm", "grad_norm_error", "raised_in_lightning_grad_norm"]

_LIGHTNING_CODE = lightning_grad_norm.__code__


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's :func:`lightning.pytorch.utilities.grad_norm` for any layout of
    :class:`~lightning_hybrid.HybridStrategy`: each parameter's gradient ``norm_type``-norm, named
    ``grad_{norm_type}_norm{group_separator}{name}`` with the one-device name, and ``grad_{norm_type}_norm_total``
    over all of them, for the whole model (every tensor-parallel and ZeRO shard, every pipeline stage; a tied weight
    once), so ``self.log_dict(grad_norm(self, norm_type=2))`` logs what ``"ddp"`` logs. Under any other strategy (or
    without a trainer) it is Lightning's function.

    Collective under HybridStrategy: call it on every rank, between the gradient reduction and the optimizer step
    (``on_before_optimizer_step``, where Lightning's documentation calls it). Cost: each gradient gathered whole, one
    parameter at a time (ZeRO-1/2: the optimizer's flat gradient shards all at once), and one object all-gather over
    the pipeline stages.

    Example:
        >>> from lightning_hybrid import grad_norm
        >>> class Module(L.LightningModule):  # doctest: +SKIP
        ...     def on_before_optimizer_step(self, optimizer):
        ...         self.log_dict(grad_norm(self, norm_type=2))
    """
    trainer = module_trainer(module)  # a LightningModule's (its `trainer` property raises without one)
    norms_of = getattr(getattr(trainer, "strategy", None), "gradient_norms", None)
    if norms_of is None:
        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:  # Lightning's check and message
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": torch.tensor(value, dtype=torch.float32)
        for name, value in norms_of(module, norm_type).items()
    }
    if norms:  # as Lightning: the norm of the norms, the gradients viewed as one vector
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def grad_norm_error(where: str) -> HybridConfigError:
    """The refusal of Lightning's ``grad_norm`` under a layout where it would not log what ``"ddp"`` logs."""
    return HybridConfigError(
        f"{where} calls Lightning's `lightning.pytorch.utilities.grad_norm`, which reads the gradients this rank"
        " holds: under tensor parallel and ZeRO-3 DTensor shards (it fails), under ZeRO-1/2 none (the optimizer's"
        " shards hold them: it returns nothing), under a pipeline one stage's (partial names and total). Use"
        " `from lightning_hybrid import grad_norm` instead: the same arguments and result, computed over the whole"
        " model, and Lightning's own function under any other strategy (docs/lightning-features.md)."
    )


def check_gradient_norm_hooks(module: Any, layout: Any, master_weights: bool) -> None:
    """Refuse, on every rank before any process group exists, a module or callback whose code names Lightning's
    ``grad_norm``, unless every rank holds every gradient whole in ``p.grad`` as ``"ddp"`` does (data parallel alone
    at ZeRO-0, without master weights). Reads the names each method of the user's classes refers to (their
    bytecode's global and attribute names): a call through code outside those classes is not seen."""
    whole = (
        layout.zero_stage == 0
        and not master_weights
        and layout.tensor_parallel_size == layout.pipeline_parallel_size == 1
        and layout.expert_parallel_size == layout.context_parallel_size == 1
    )
    if whole:
        return
    trainer = module_trainer(module)
    holders = [module, *(getattr(trainer, "callbacks", None) or [])]
    for holder in holders:
        for name, function in _user_methods(type(holder)):
            # the module's globals, and the names a function defined inside another takes from it (a closure)
            cells = zip(function.__code__.co_freevars, function.__closure__ or ())
            namespace = {**function.__globals__, **{name: _cell_value(cell) for name, cell in cells}}
            if _names_lightning_grad_norm(function.__code__, namespace):
                raise grad_norm_error(f"`{type(holder).__name__}.{name}`")


def raised_in_lightning_grad_norm(error: BaseException) -> bool:
    """Whether ``error`` was raised inside Lightning's ``grad_norm`` (its traceback passes through its code)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _LIGHTNING_CODE:
            return True
        tb = tb.tb_next
    return False


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _user_methods(cls: type) -> Iterator[tuple[str, types.FunctionType]]:
    """The functions defined by ``cls`` and its bases outside Lightning and torch (the user's own code)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        root = klass.__module__.split(".")[0]
        if root in ("lightning", "pytorch_lightning", "torch", "builtins", "lightning_hybrid", "torchmetrics"):
            continue
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            function = getattr(value, "__func__", value)  # static and class methods
            if isinstance(function, types.FunctionType):
                yield name, function


def _names_lightning_grad_norm(code: types.CodeType, namespace: dict[str, Any]) -> bool:
    """Whether ``code`` (or a function, lambda or comprehension inside it) refers to Lightning's ``grad_norm``: by a
    global name bound to it, or as the attribute ``grad_norm`` of a Lightning module it names."""
    for name in code.co_names + code.co_freevars:
        value = namespace.get(name)
        if value is lightning_grad_norm:
            return True
        if (
            "grad_norm" in code.co_names
            and "grad_norm" not in namespace  # `grad_norm` read as an attribute, not this module's own name
            and isinstance(value, types.ModuleType)
            and value.__name__.split(".")[0] in ("lightning", "pytorch_lightning")
        ):
            return True
    return any(
        _names_lightning_grad_norm(const, namespace) for const in code.co_consts if isinstance(const, types.CodeType)
    )
