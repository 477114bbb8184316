"""Forward hooks that rewrite a block's hidden-state input or output, whether it comes positionally or by keyword.

Shared by sequence parallel (re-layout at region borders) and the pipeline (substitute the received activation,
stop after a stage's last block): torch's ``PrepareModuleInput`` needs to know in advance which of the two it is.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from torch import nn

HIDDEN_KWARGS = ("hidden_states", "x", "hidden", "input", "inputs_embeds")


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` and in its lists, tuples and dicts, in order (a forward's arguments or outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def first_tensor(args: tuple, kwargs: dict) -> Optional[tuple[Union[str, int], torch.Tensor]]:
    """Where the hidden state is: the first positional tensor, else a conventionally named keyword."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    for key in HIDDEN_KWARGS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return key, kwargs[key]
    return None


def map_first_input(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A ``register_forward_pre_hook(..., with_kwargs=True)`` hook applying ``fn`` to the hidden-state input."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        found = first_tensor(args, kwargs)
        if found is None:
            return args, kwargs
        key, tensor = found
        if isinstance(key, int):
            args = (*args[:key], fn(tensor), *args[key + 1 :])
        else:
            kwargs = {**kwargs, key: fn(tensor)}
        return args, kwargs

    return hook


def map_output(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A ``register_forward_hook`` hook applying ``fn`` to the hidden-state output (a tensor or a tuple's first)."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return fn(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (fn(output[0]), *output[1:])
        return output

    return hook


@contextmanager
def attribute_replaced(module: object, name: str, value: Any) -> Generator[None, None, None]:
    """``module.<name>`` is ``value`` meanwhile, then what it was. The instance dict is written directly:
    ``nn.Module.__setattr__`` checks parameters, buffers and submodules on every call, for a plain attribute (once per
    micro-batch in the pipeline)."""
    attrs = module.__dict__
    previous = attrs.get(name, _MISSING)
    attrs[name] = value
    try:
        yield
    finally:
        if previous is _MISSING:
            del attrs[name]
        else:
            attrs[name] = previous


def forward_replaced(module: nn.Module, fn: Callable) -> Any:
    """``module``'s calls run ``fn`` meanwhile (a context manager)."""
    return attribute_replaced(module, "forward", fn)


_MISSING = object()
