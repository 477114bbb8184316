"""What a pipeline step leaves on the LightningModule, the same on every stage.

Under a pipeline only the last stage has the network's output; the earlier stages run the code after the network
call on stand-ins (docs/step-semantics.md). What that code keeps on ``self`` (``self.outputs.append(preds)``, then
``torch.cat(self.outputs)`` in ``on_validation_epoch_end``: Lightning's own pattern since ``*_epoch_end`` went) would
be stand-ins there, and reading them fails outside the step, on rank 0 too, which logs. So after each step the last
stage sends what the step changed on the module that holds tensors (:meth:`StateMirror.changes`), and the other
stages put it in place of their own (:meth:`StateMirror.apply`): attributes set or rebound, items appended to a list,
keys set in a dict. With the step's other results, in the one broadcast a step already makes (its object form).
Where a value read of the output ends the step early on the stand-in ranks, plain numbers and strings it sets are
mirrored too (:attr:`StateMirror.every_value`): those ranks never reached the code that sets them.

Cost: nothing unless the step keeps tensors on the module; then those tensors, once per step, to every other stage
of the pipeline (what "ddp" holds on every rank anyway). Only the LightningModule's own attributes are followed, not
its submodules' (the network's state is its stages').
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.dtensor import to_plain

__all__ = ["StateMirror"]

Changes = dict[str, tuple[str, Any]]
"""Attribute name -> ("set", value) | ("append", (start, items)) | ("keys", {key: value})."""


_SCALARS = (int, float, bool, str, type(None))


def _holds_tensor(value: Any) -> bool:
    """A tensor, or plain lists, tuples and dicts of tensors and scalars holding one. Other objects are not followed:
    they may not pickle, and what the broadcast sends must."""
    if isinstance(value, Tensor):
        return True
    if type(value) in (list, tuple):
        return all(isinstance(v, (Tensor, *_SCALARS)) or _holds_tensor(v) for v in value) and any(
            isinstance(v, Tensor) or _holds_tensor(v) for v in value
        )
    if type(value) is dict:
        return _holds_tensor(list(value.values()))
    return False


def _plain(value: Any) -> bool:
    """A number, string or None, a tensor, or plain lists, tuples and dicts of them (what pickles as it is)."""
    if isinstance(value, (Tensor, *_SCALARS)):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return type(value) is dict and all(_plain(v) for v in value.values())


def _sendable(value: Any) -> Any:
    """Plain, detached, on the CPU (a DTensor made the tensor it stands for)."""
    return apply_to_collection(value, Tensor, lambda t: (to_plain(t) if isinstance(t, DTensor) else t).detach().cpu())


class StateMirror:
    """Follows the module's attributes across one step: :meth:`begin` before it, :meth:`changes` after it on the last
    stage, :meth:`apply` on the others.

    Example:
        >>> last, other = nn.Module(), nn.Module()
        >>> last.outputs, other.outputs = [], []
        >>> sender, receiver = StateMirror(last), StateMirror(other)
        >>> sender.begin(); receiver.begin()
        >>> last.outputs.append(torch.tensor([1, 2])); other.outputs.append(torch.zeros(2, dtype=torch.long))
        >>> last.seen = torch.tensor(3)
        >>> receiver.apply(sender.changes(), torch.device("cpu"))
        >>> other.outputs, other.seen
        ([tensor([1, 2])], tensor(3))
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.every_value = False
        """Also what the step sets that holds no tensor (a counter after the call), where the stand-in ranks' run of
        the step ends early (a value read of the output): theirs never reached it. The runner sets it per step."""
        self._before: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._keys: dict[str, dict[Any, Any]] = {}

    def begin(self) -> None:
        """Before the step: the attributes as they are (names and objects), each list's length, each dict's items."""
        attributes = self.module.__dict__
        self._before = dict(attributes)
        self._sizes = {k: len(v) for k, v in attributes.items() if type(v) is list}
        self._keys = {k: dict(v) for k, v in attributes.items() if type(v) is dict and not k.startswith("_")}

    def changes(self) -> Optional[Changes]:
        """After the step on the last stage: what it changed that holds tensors (or, with :attr:`every_value`, any
        plain value), ready to send (None: nothing)."""
        out: Changes = {}
        kept = _plain if self.every_value else _holds_tensor
        for name, value in self.module.__dict__.items():
            if name.startswith("_") and name not in self._sizes:
                continue  # nn.Module's and Lightning's own bookkeeping
            if self._before.get(name, _MISSING) is not value:
                if kept(value):
                    out[name] = ("set", _sendable(value))
            elif name in self._sizes and len(value) > self._sizes[name]:
                added = value[self._sizes[name] :]
                if kept(added):
                    out[name] = ("append", (self._sizes[name], _sendable(added)))
            elif name in self._keys:
                before = self._keys[name]
                changed = {k: v for k, v in value.items() if before.get(k, _MISSING) is not v}
                if changed and kept(changed):
                    out[name] = ("keys", _sendable(changed))
        return out or None

    def apply(self, changes: Optional[Changes], device: torch.device) -> None:
        """On another stage: the last stage's values in place of what this rank's run of the step left."""
        for name, (kind, value) in (changes or {}).items():
            value = apply_to_collection(value, Tensor, lambda t: t.to(device))
            current = self.module.__dict__.get(name)
            if kind == "append" and type(current) is list:
                start, items = value
                current[start:] = items  # this rank's own appends (on stand-ins, or none) replaced
            elif kind == "keys" and type(current) is dict:
                current.update(value)
            else:
                setattr(self.module, name, value[1] if kind == "append" else value)


_MISSING = object()
