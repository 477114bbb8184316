"""A run of the user's step that is a check's, not the run's, leaves nothing the user's code can see.

Context parallel's first-step probe (context_parallel/verify.py) runs the user's step on given outputs to test the
loss function itself; issue 45's contract is that the step runs once per micro-batch as far as user code can tell.
:func:`unseen_run` puts back, after the block, what a step typically leaves behind: attributes set or rebound on
any module of the LightningModule's tree (a counter on ``self``), the items of lists, dicts and sets they hold (an
append to ``self.outputs``), buffers outside the network, torchmetrics states; and it keeps the block's prints and
warnings from the terminal. The random state and ``self.log`` are the caller's to keep (the probe does both).

Not put back: what the step changes outside the module (a module-level global, a file it writes), objects nested
inside its containers, and tensors it changes in place that are neither buffers nor metric states.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from lightning_hybrid.monitoring.metrics import MetricMirror

__all__ = ["unseen_run"]

# nn.Module's own bookkeeping (parameters, buffers, submodules, hooks): put back by binding only, never by content
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


@contextlib.contextmanager
def unseen_run(module: nn.Module, network: Optional[nn.Module] = None) -> Iterator[None]:
    """After the block, ``module``'s tree as it was before (see the module's docstring); ``network``'s subtree is
    skipped (a probe replaces the network while it runs: nothing of it changes, and a large model's tree is not worth
    walking). Prints and warnings inside the block are dropped.

    Example:
        >>> class Counting(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.calls, self.seen = 0, []
        >>> m = Counting()
        >>> with unseen_run(m):
        ...     m.calls += 1
        ...     m.seen.append("x")
        ...     m.extra = True
        ...     print("not shown")
        >>> m.calls, m.seen, hasattr(m, "extra")
        (0, [], False)
    """
    skipped = {id(m) for m in network.modules()} if network is not None else set()
    saved = [(m, _snapshot(m)) for m in module.modules() if id(m) not in skipped]
    # the metric states are tensors a step updates in place (`self.total += x`): copied and put back by the mirror
    with MetricMirror(module).unchanged(), warnings.catch_warnings(record=True):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                yield
            finally:
                for m, snapshot in saved:
                    _restore(m, snapshot)


_Snapshot = tuple[dict[str, Any], dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]


def _snapshot(m: nn.Module) -> _Snapshot:
    attributes = dict(m.__dict__)
    contents = {k: c for k, v in attributes.items() if k not in _MODULE_INTERNALS and (c := _contents(v)) is not None}
    buffers = {k: (b, b.detach().clone()) for k, b in m.named_buffers(recurse=False)}
    return attributes, contents, buffers


def _contents(value: Any) -> Any:
    """A shallow copy of a plain list, dict or set (what a step appends to or fills); None for anything else."""
    if type(value) in (list, dict, set):
        return type(value)(value)
    return None


def _restore(m: nn.Module, snapshot: _Snapshot) -> None:
    attributes, contents, buffers = snapshot
    for key in [k for k in m.__dict__ if k not in attributes]:
        del m.__dict__[key]
    m.__dict__.update(attributes)
    for key, items in contents.items():
        container = attributes[key]
        if isinstance(container, list):
            container[:] = items
        else:
            container.clear()
            container.update(items)
    for key in [k for k, _ in m.named_buffers(recurse=False) if k not in buffers]:
        delattr(m, key)  # registered during the block
    with torch.no_grad():
        for key, (original, values) in buffers.items():
            setattr(m, key, original)  # a registered buffer's name: the module puts it back among its buffers
            original.copy_(values)
