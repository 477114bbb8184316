"""Errors that every rank raises together, so that one rank's failure never leaves the others waiting in a collective.

Set-up work that can fail differs between ranks: a pipeline rank checks only the stages it holds, and profiling runs on
one rank. A rank that raises while its peers enter a collective leaves them hanging until the collective timeout, or
dying of gloo's "Connection closed by peer" with no word of the cause. torch has no primitive for this (its collectives
carry tensors or objects, not exceptions), so the two helpers here share the outcome explicitly:

- :func:`raise_together` runs a block of collective-free work on every rank, then shares whether (and why) any rank
  failed; every rank raises the same error.
- :func:`computed_on_one_rank` runs a function on one rank and broadcasts its result, or the error it raised.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

import torch.distributed as dist

from lightning_hybrid.config import HybridConfigError

__all__ = ["computed_on_one_rank", "raise_together"]

T = TypeVar("T")


def _describe(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _raise_shared(outcomes: list[Optional[tuple[str, str]]], own: Optional[BaseException]) -> None:
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    if own is not None:
        raise own  # this rank's own error, with its traceback
    rank, (kind, message) = failed[0]
    if kind == HybridConfigError.__name__:
        raise HybridConfigError(message)  # the same message as on the rank that found it
    raise RuntimeError(f"rank {rank} failed during set-up with {kind}: {message}")


@contextmanager
def raise_together(group: Any = None) -> Generator[None, None, None]:
    """Run the block on every rank; if it raises on any rank, raise on all of them (the first failing rank's error).

    The block must hold no collective: a rank that fails skips the rest of it. Costs one small object all-gather.

    Example:
        >>> with raise_together():  # doctest: +SKIP
        ...     plan = build_plan(module)  # may fail on one pipeline rank only
    """
    own: Optional[BaseException] = None
    try:
        yield
    except Exception as error:  # shared below; a KeyboardInterrupt or SystemExit is not ours to hold back
        own = error
    if not (dist.is_available() and dist.is_initialized()):
        if own is not None:
            raise own
        return
    outcomes: list[Optional[tuple[str, str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, _describe(own) if own is not None else None, group=group)
    _raise_shared(outcomes, own)


def computed_on_one_rank(fn: Callable[[], T], src: int = 0, group: Any = None) -> T:
    """``fn()`` run on global rank ``src`` only, its result broadcast to every rank; an error it raises is raised on
    every rank instead (where the broadcast would otherwise leave the other ranks waiting for a result).

    Example:
        >>> costs = computed_on_one_rank(lambda: time_each_block(network))  # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    own: Optional[BaseException] = None
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            payload[0] = ("ok", fn())
        except Exception as error:
            own = error
            payload[0] = ("error", _describe(error))
    dist.broadcast_object_list(payload, src=src, group=group)
    status, value = payload[0]
    if status == "ok":
        return value
    outcomes: list[Optional[tuple[str, str]]] = [None] * (src + 1)
    outcomes[src] = value
    _raise_shared(outcomes, own)
    raise AssertionError("unreachable")  # _raise_shared raised
