"""Stand-ins for the network's output on the stages that do not compute it.

A rank without the last stage runs each micro-batch's step up to its network call, like every rank; what the step
does after the call (a second call of the network on another view, the chosen and rejected halves of a preference
pair) it needs to know too, for it computes those calls' first stages. It resumes the step with a stand-in for the
output: a tensor of the output's shape, dtype and device that holds no values (:class:`StandIn`). Operations on it
give stand-ins again, computed on the meta device (shapes only, no memory, no compute), so the code between two
calls runs to the next call and shows its arguments. A value read of a stand-in (``.item()``, ``bool()``, a boolean
mask's data-dependent shape) cannot be answered: it ends the step on that rank (:class:`StandInRead`), which only
matters where a network call would follow it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hybrid._hooks import tensors_in
from lightning_hybrid._torch_compat import DISABLED_TORCH_FUNCTION, make_wrapper_tensor, tree_flatten, tree_unflatten
from lightning_hybrid.pipeline.boundaries import map_tensors, to_meta

__all__ = ["StandIn", "StandInOutputs", "StandInRead", "contains_stand_in"]


class StandInRead(BaseException):
    """A stand-in's value was read: the step cannot go on without the real output. A ``BaseException``: a user's
    ``try/except Exception`` around the read must not swallow it."""


_VALUE_READS = {"_local_scalar_dense", "is_nonzero", "equal", "item", "allclose"}


class StandIn(Tensor):
    """A tensor with a shape, dtype and device but no values, computed on the meta device.

    Example:
        >>> x = StandIn(torch.empty(2, 3, device="meta"), torch.device("cpu"))
        >>> y = (x * torch.ones(3)).sum(-1)
        >>> type(y).__name__, tuple(y.shape), y.device.type
        ('StandIn', (2,), 'cpu')
        >>> try:
        ...     y[0].item()
        ... except StandInRead:
        ...     print("no value")
        no value
    """

    _meta: Tensor

    @staticmethod
    def __new__(cls, meta: Tensor, device: torch.device) -> StandIn:
        made = make_wrapper_tensor(cls, tuple(meta.shape), meta.dtype, device, strides=tuple(meta.stride()),
                                   requires_grad=meta.requires_grad)  # fmt: skip
        made._meta = meta
        return made  # type: ignore[return-value]

    __torch_function__ = DISABLED_TORCH_FUNCTION

    def __repr__(self) -> str:  # type: ignore[override]
        return f"StandIn(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in _VALUE_READS:
            raise StandInRead(f"`{name}` of a value the network computes on another pipeline stage")
        leaves, spec = tree_flatten((args, kwargs or {}))
        device = next((t.device for t in leaves if isinstance(t, StandIn)), torch.device("cpu"))
        # the same operation on arguments of the same shapes gives outputs of the same shapes: computed on meta once
        # (torch's meta kernels are Python decompositions, a millisecond a micro-batch's loss), then looked up
        key = (func, len(leaves), *map(_leaf_key, leaves))
        known = _OUTPUTS.get(key)
        if known is None:
            try:
                meta_args, meta_kwargs = tree_unflatten([_to_meta(t) for t in leaves], spec)
                known = tree_flatten(func(*meta_args, **meta_kwargs))
            except Exception as error:  # a data-dependent shape (nonzero, a boolean mask) has no meta answer
                known = _NoMetaAnswer(str(error))  # the message only: a traceback would keep the step's frames
            if len(_OUTPUTS) < _CACHE_SIZE:
                _OUTPUTS[key] = known
        if isinstance(known, _NoMetaAnswer):
            raise StandInRead(f"`{name}` needs the values of the network's output ({known.message})") from None
        out_leaves, out_spec = known
        made = [StandIn(t, device) if isinstance(t, Tensor) and t.device.type == "meta" else t for t in out_leaves]
        return tree_unflatten(made, out_spec)


class _NoMetaAnswer:
    def __init__(self, message: str) -> None:
        self.message = message


_CACHE_SIZE = 4096
_OUTPUTS: dict[tuple, Any] = {}
"""Per operation and argument signature: its outputs on meta tensors (flattened), or why it has none."""


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (type(leaf) is StandIn, tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type)
    try:
        hash(leaf)
    except TypeError:
        return id(leaf)
    return leaf


def _to_meta(t: Any) -> Any:
    if isinstance(t, StandIn):
        return t._meta
    if isinstance(t, Tensor) and t.device.type != "meta":
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


class StandInOutputs:
    """Stand-ins for a network's output on a call's arguments: the forward of ``unsplit`` (its copy on the meta device,
    taken before the cut) on meta copies of them, under the call's thread state, cached per input signature; None
    where that forward cannot run on meta tensors (it reads values) or there is no copy.

    Example:
        >>> from torch import nn
        >>> from lightning_hybrid.pipeline.boundaries import meta_copy
        >>> from lightning_hybrid.pipeline.paused import NetworkCall, ThreadState
        >>> outputs = StandInOutputs(meta_copy(nn.Linear(3, 2)), torch.device("cpu"))
        >>> outputs(NetworkCall((torch.ones(4, 3),), {}, ThreadState.capture())).shape
        torch.Size([4, 2])
    """

    def __init__(self, unsplit: Optional[torch.nn.Module], device: torch.device) -> None:
        self.unsplit, self.device = unsplit, device
        self._meta: dict[tuple, Any] = {}

    def __call__(self, call: Any) -> Any:
        if self.unsplit is None:
            return None
        key = (tuple((tuple(t.shape), t.dtype) for t in tensors_in((call.args, call.kwargs))), call.state.autocast)
        if key not in self._meta:
            try:
                with torch.no_grad(), call.state.applied():
                    self._meta[key] = self.unsplit(*to_meta(call.args), **to_meta(call.kwargs))
            except Exception:  # a forward that reads values cannot run on meta tensors
                self._meta[key] = None
        meta = self._meta[key]
        return map_tensors(lambda t: StandIn(t.detach(), self.device))(meta) if meta is not None else None


def contains_stand_in(obj: Any) -> bool:
    """Whether a call's arguments hold a stand-in (or a tensor computed from one)."""
    if isinstance(obj, StandIn):
        return True
    if isinstance(obj, dict):
        return any(contains_stand_in(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(contains_stand_in(v) for v in obj)
    return False
