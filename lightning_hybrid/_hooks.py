"""Forward hooks that rewrite a block's hidden-state input or output, whether it comes positionally or by keyword,
and one that stops a run at a module's call to capture its arguments.

Shared by sequence parallel (re-layout at region borders) and the pipeline (substitute the received activation,
stop after a stage's last block): torch's ``PrepareModuleInput`` needs to know in advance which of the two it is.
:func:`capture_call` is how the pipeline finds the hidden state entering the block list, and context parallel's probe
the network's inputs.
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


class _Reached(BaseException):
    """Raised at the network's call to end the user's step there (:func:`capture_call`). A ``BaseException``, as
    ``GeneratorExit`` is: a step that wraps its network call in ``try/except Exception`` would otherwise catch it."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.call = (args, kwargs)


def capture_call(module: nn.Module, run: Callable[[], Any]) -> Optional[tuple[tuple, dict]]:
    """``run()`` up to ``module``'s first call: that call's (args, kwargs) as ``module`` receives them, before its
    other forward pre-hooks; None if ``run`` returned without calling ``module``. Nothing after the call runs, so
    capturing the network's inputs from the user's step costs the step's code before the network only.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> capture_call(net, lambda: net(1.0) + 1)
        ((1.0,), {})
    """

    return capture_calls(module, [run])[0]


def capture_calls(module: nn.Module, runs: list[Callable[[], Any]]) -> list[Optional[tuple[tuple, dict]]]:
    """:func:`capture_call` for each of ``runs`` in turn, under one hook (the pipeline captures every micro-batch of
    a step: one registration per step, not per micro-batch)."""

    def reached(_: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Reached(args, kwargs)

    calls: list[Optional[tuple[tuple, dict]]] = []
    handle = module.register_forward_pre_hook(reached, with_kwargs=True, prepend=True)
    try:
        for run in runs:
            try:
                run()
            except _Reached as stop:
                calls.append(stop.call)
            else:
                calls.append(None)
    finally:
        handle.remove()
    return calls
