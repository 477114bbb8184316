"""The point-to-point transfers a rank has posted and not yet seen through, told to observers (the hang watchdog).

torch's flight recorder records every collective in C++ (NCCL and gloo, DTensor's functional collectives included),
but not, under gloo, a ``send``/``recv``: the pipeline's activations and gradients. Nothing in torch tells a
listener when one starts or ends either, short of replacing the c10d functions for the whole process (which this
package did, and no longer does). So the package's own code that posts transfers says so here: the pipeline's stages
(``pipeline/step_data.py``: torch's schedules ask a stage for its send/receive ops, then wait for them) report each
op they hand out, and when the transfer is over: a receive when the action that reads it starts, a send when the
schedule's step ends (torch's schedules wait for every send by then, some only after later actions: 1F1B's warm-up
waits for a micro-batch's send after the next forward, so a send's end cannot be told earlier). A transfer another
library posts is not seen here: a hang in one shows as the collective (or nothing) the flight recorder has for that
rank.

A leaf: it knows neither the watchdog nor the pipeline. Observers are called on the posting thread: keep them to a
few dictionary operations (one call per transfer, a few per micro-batch).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["P2P", "P2PObserver", "PendingTransfers", "observe_p2p_waits"]

P2P = tuple[str, Any, Optional[int]]
"""(``"send"`` or ``"recv"``, process group, global peer rank) of one point-to-point transfer."""


class P2PObserver:
    """Told when a point-to-point transfer starts to be waited for and when it is over."""

    def p2p_wait_begin(self, op: str, group: Any, peer: Optional[int]) -> Any:
        """``op`` is ``"send"`` or ``"recv"``, ``peer`` the global rank; returns a token for ``p2p_wait_end``."""
        raise NotImplementedError

    def p2p_wait_end(self, token: Any, failed: bool) -> None:
        """``failed``: the transfer did not complete (the step raised)."""
        raise NotImplementedError


class _Observers:
    """The package's observers (the watchdog's, one per fit). A list of its own, not a hook in torch."""

    lock = threading.Lock()
    active: list[P2PObserver] = []


def observe_p2p_waits(observer: P2PObserver, active: bool = True) -> None:
    """Add (or with ``active=False`` remove) an observer of the transfers the package posts."""
    with _Observers.lock:
        if active and observer not in _Observers.active:
            _Observers.active = [*_Observers.active, observer]
        elif not active and observer in _Observers.active:
            _Observers.active = [o for o in _Observers.active if o is not observer]


def _describe(op: Any) -> P2P:
    """(direction, group, global peer) of a ``torch.distributed.P2POp``."""
    return ("send" if op.op is dist.isend else "recv"), op.group, op.peer


class PendingTransfers:
    """The transfers of one rank's pipeline stages that are posted and not yet over, each told to the observers.

    A receive is keyed by what will read it (``(kind, stage, micro-batch)``: the forward or backward action of that
    stage), and is over when that action starts; sends are over when the step ends (torch's schedules wait for them
    by then). A step's sends are a few per micro-batch.

    Example:
        >>> pending = PendingTransfers()
        >>> pending.posted(("F", 1, 0), [])      # no observer, no op: nothing to note
        >>> pending.action_starts(("F", 1, 0))
        >>> pending.clear()
    """

    def __init__(self) -> None:
        self._receives: dict[tuple[str, int, int], list[tuple[P2PObserver, Any]]] = {}
        self._sends: list[tuple[P2PObserver, Any]] = []

    def posted(self, reader: Optional[tuple[str, int, int]], ops: Iterable[Any]) -> None:
        """``ops`` (``P2POp``s) were handed to the schedule; ``reader`` is the action that reads the received ones
        (None for sends)."""
        observers = _Observers.active
        if not observers:
            return
        for op in ops:
            p2p = _describe(op)
            tokens = [(o, o.p2p_wait_begin(*p2p)) for o in observers]
            if p2p[0] == "send" or reader is None:
                self._sends.extend(tokens)
            else:
                self._receives.setdefault(reader, []).extend(tokens)

    def action_starts(self, action: tuple[str, int, int]) -> None:
        """A compute action starts: the receives it reads are in."""
        if self._receives:
            self._end(self._receives.pop(action, []))

    def clear(self, failed: bool = False) -> None:
        """The step is over (or ``failed``): nothing pending."""
        self._end(self._sends, failed)
        for tokens in self._receives.values():
            self._end(tokens, failed)
        self._sends, self._receives = [], {}

    @staticmethod
    def _end(tokens: list[tuple[P2PObserver, Any]], failed: bool = False) -> None:
        for observer, token in tokens:
            observer.p2p_wait_end(token, failed)
