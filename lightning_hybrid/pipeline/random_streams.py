"""Which random numbers each part of a pipeline step draws, so that every rank computing a micro-batch draws the same.

On one device a step's draws come from the default generators in program order: the step's code before the network
(a BERT mask, diffusion noise), the network's dropout, the code after it. Under a pipeline the ranks of one replica do
different parts of that order: each runs every micro-batch's step up to its network call (the same code, in the same
order, so the same draws), then only its own stages' compute, and only the last stage the code after the call. So:

* the code before the first network call of each micro-batch draws from the default generators, as on one device:
  every rank runs those parts first, in micro-batch order (``"before"``);
* the network's compute on this rank draws from a stream derived from the state after them (``"network"``);
* each micro-batch's code after its first network call draws from a stream of its own (``("after", i)``), the same
  on every rank that runs it (the last stage's ranks, and a rank that runs the step on to its next call);
* after the step, the default generators are back at the state after the code before the calls.

So a step whose draws all come before its network call, in a network without dropout, draws exactly what one device
draws (the same masks, the same noise); draws after the call and dropout masks are the same on every rank that
computes them and differ from one device's. Derived streams are seeded by a hash of the state they derive from, so
two steps never share one. Cost: a few copies of the generators' states a micro-batch (5 KB on the CPU; the CUDA
generator's state is its seed and offset, kept on the host): no device work, no host synchronization.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["RandomStreams"]


@dataclass
class _State:
    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]

    @classmethod
    def current(cls, cuda: Optional[int]) -> _State:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda is not None else None)

    def restore(self, cuda: Optional[int]) -> None:
        torch.set_rng_state(self.cpu)
        if cuda is not None and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, cuda)

    def derived(self, key: Any, cuda: Optional[int]) -> _State:
        digest = hashlib.blake2b(self.cpu.numpy().tobytes(), digest_size=8)
        if self.cuda is not None:
            digest.update(self.cuda.numpy().tobytes())
        digest.update(repr(key).encode())
        seed = int.from_bytes(digest.digest(), "little") & (2**63 - 1)
        cpu = torch.Generator().manual_seed(seed).get_state()
        made = None
        if cuda is not None:
            made = torch.Generator(device=f"cuda:{cuda}").manual_seed(seed).get_state()
        return _State(cpu, made)


class RandomStreams:
    """The random streams of one pipeline step (see the module's docstring): :meth:`begin` after every micro-batch's
    step has run to its first network call, :meth:`use` to switch the default generators to a stream, :meth:`end`
    after the step.

    Example:
        >>> streams = RandomStreams(torch.device("cpu"))
        >>> _ = torch.manual_seed(0); mask = torch.rand(2)  # the steps' code before their network calls
        >>> streams.begin()
        >>> streams.use("network"); dropout = torch.rand(2)
        >>> streams.use(("after", 0)); noise = torch.rand(2)
        >>> streams.end(); following = torch.rand(2)
        >>> _ = torch.manual_seed(0); _ = torch.rand(2)
        >>> torch.equal(following, torch.rand(2)), torch.equal(dropout, noise)  # as if only `mask` was drawn
        (True, False)
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = (device.index if device.index is not None else torch.cuda.current_device()) if (
            device.type == "cuda"
        ) else None
        self._states: dict[Any, _State] = {}
        self._base: Optional[_State] = None
        self.active: Any = None

    def begin(self) -> None:
        """The steps' code before their network calls has run: the state now is the one the run continues from."""
        self._base = _State.current(self._cuda)
        self._states = {"before": self._base}
        self.active = "before"

    def use(self, stream: Any) -> None:
        """Draw from ``stream`` (``"network"``, ``("after", i)``, ``"before"``) from now on; the stream left keeps
        its place."""
        if self.active is None or stream == self.active:
            return
        self._states[self.active] = _State.current(self._cuda)
        state = self._states.get(stream)
        if state is None:
            assert self._base is not None
            state = self._states[stream] = self._base.derived(stream, self._cuda)
        state.restore(self._cuda)
        self.active = stream

    def end(self) -> None:
        """Back at the state after the steps' code before their calls; the derived streams are dropped."""
        if self.active is None:
            return
        self.use("before")
        self._states, self._base, self.active = {}, None, None
