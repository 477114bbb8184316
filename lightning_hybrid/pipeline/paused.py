"""Each micro-batch's run of the user's step, paused at its calls of the network.

Under a pipeline the network's output exists only on the last stage, and only once the schedule has run the earlier
stages; the user's step, though, is one Python function that computes the network's inputs, calls the network and
computes the loss from its output. So every rank runs each micro-batch's step *once*, in a thread of its own that
pauses at each call of the network (:class:`PausedStep`): the code before the call has run (its random draws, its
counters, its prints), the call's arguments are known, and the schedule resumes the step with the output when it has
one (the last stage) or ends it there (the other stages). A thread, not a generator, because the user's step is plain
Python that cannot ``yield``; Python has no other way to keep a frame waiting (a greenlet would share the thread's
torch state with the schedule). The thread hands control back and forth: exactly one of it and the rank's main thread
runs at a time, so the step's code runs as if in the main thread, in order.

What torch keeps per thread (grad mode, inference mode, autocast, the current CUDA device and stream, the default
device) is given to the step's thread as the loop gave it to the step (:class:`ThreadState`), and each call of the
network records the state the step had at the call, which the stage's compute then runs under: a step that calls its
network under ``torch.autocast(...)`` or ``torch.no_grad()`` gets that on every stage, as on one device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "NetworkCall",
    "PausedStep",
    "StepEnded",
    "StepThreads",
    "ThreadState",
    "mark_raised_by_the_step",
    "raised_by_the_step",
]

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """What torch keeps per thread and a step's code can change: grad mode, inference mode, autocast per device type
    (enabled, dtype) and its cache, the default device, and on CUDA the current device and stream.

    Example:
        >>> with torch.no_grad():
        ...     state = ThreadState.capture()
        >>> with state.applied():
        ...     torch.is_grad_enabled()
        False
    """

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    default_device: Optional[torch.device]
    cuda: Optional[tuple[int, Any]]

    @classmethod
    def capture(cls) -> ThreadState:
        """The calling thread's state."""
        devices = [d for d in _AUTOCAST_DEVICES if d == "cpu" or torch.cuda.is_available()]
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)
        default = torch.get_default_device()
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = (torch.cuda.current_device(), torch.cuda.current_stream())
        return cls(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            default_device=default if default.type != "cpu" else None,
            cuda=cuda,
        )

    @contextmanager
    def applied(self) -> Generator[None, None, None]:
        """The calling thread under this state meanwhile (what it was before, after)."""
        with ExitStack() as stack:
            if self.cuda is not None:
                device, stream = self.cuda
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            if self.default_device is not None:
                stack.enter_context(self.default_device)
            if self.inference != torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, enabled, dtype in self.autocast:
                if enabled or torch.is_autocast_enabled(device):
                    stack.enter_context(
                        torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                    )
            yield


@dataclass
class NetworkCall:
    """One call of the network by a paused step: its arguments and the thread state it was made under."""

    args: tuple
    kwargs: dict
    state: ThreadState


class StepEnded(BaseException):
    """Raised at a paused call to end the step there (its ``finally`` blocks and context managers run). A
    ``BaseException``, as ``GeneratorExit`` is: a step that wraps its network call in ``try/except Exception`` must
    not catch it."""


_current = threading.local()


def paused_call(args: tuple, kwargs: dict) -> Any:
    """What the network's forward does while a step runs in a :class:`PausedStep` (the runner installs it): pause the
    step until the runner gives the call's output. A call from any other thread is a call outside a step."""
    step: Optional[PausedStep] = getattr(_current, "running", None)
    if step is None:
        raise RuntimeError("lightning-hybrid: the pipelined network was called outside the step the pipeline runs.")
    return step._pause(NetworkCall(args, kwargs, ThreadState.capture()))


class StepThreads:
    """Worker threads that run paused steps, kept for the next step (starting a thread costs about as much as
    several hand-overs); :meth:`close` ends them (the strategy's teardown)."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []

    def take(self) -> _Worker:
        if self._idle:
            return self._idle.pop()
        worker = _Worker()
        self._all.append(worker)
        return worker

    def give_back(self, worker: _Worker) -> None:
        self._idle.append(worker)

    def close(self) -> None:
        for worker in self._all:
            worker.stop()
        self._all, self._idle = [], []


class _Worker:
    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Optional[Callable[[], None]]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="lightning-hybrid-step", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            task()

    def stop(self) -> None:
        self.tasks.put(None)
        self.thread.join(timeout=10)


_PAUSED, _DONE, _FAILED = "paused", "done", "failed"


class PausedStep:
    """One micro-batch's run of ``run`` (the user's step on it), in a worker thread, paused at each network call.

    :meth:`start` runs it to its first call (or its end); :meth:`resume` hands the pending call its output and runs to
    the next; :meth:`end` ends it at the pending call. Between them the step's thread waits and the caller runs.
    ``pending`` is the call it waits at (None once it returned: ``result`` holds what it returned), ``calls`` every
    call it made. An error of the step is raised in the caller, with the step's traceback.

    Example:
        >>> threads = StepThreads()
        >>> def step():
        ...     return paused_call((1,), {}) + 1
        >>> s = PausedStep(step, threads, ThreadState.capture())
        >>> s.start(); s.pending.args
        (1,)
        >>> s.resume(41); s.result
        42
        >>> threads.close()
    """

    def __init__(self, run: Callable[[], Any], threads: StepThreads, state: ThreadState) -> None:
        self._run, self._threads, self._state = run, threads, state
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._worker: Optional[_Worker] = None
        self.pending: Optional[NetworkCall] = None
        self.calls: list[NetworkCall] = []
        self.result: Any = None
        self.done = False

    # ------------------------------------------------------------------ the caller's side
    def start(self) -> None:
        self._worker = self._threads.take()
        self._worker.tasks.put(self._body)
        self._wait()

    def resume(self, output: Any) -> None:
        """Give the pending call ``output``; run the step to its next call or its end."""
        assert self.pending is not None, "resume() of a step that is not paused"
        self._inbox.put(("output", output))
        self._wait()

    def end(self) -> None:
        """End the step at its pending call (nothing if it has returned)."""
        if self.pending is None:
            return
        self._inbox.put(("end", None))
        self._wait()

    def _wait(self) -> None:
        kind, value = self._outbox.get()
        if kind == _PAUSED:
            self.pending = value
            self.calls.append(value)
            return
        self.pending, self.done = None, True
        if self._worker is not None:
            self._threads.give_back(self._worker)
            self._worker = None
        if kind == _FAILED:
            raise value.with_traceback(value.__traceback__)
        self.result = value

    # ------------------------------------------------------------------ the step's thread
    def _body(self) -> None:
        _current.running = self
        try:
            with self._state.applied():
                result = self._run()
        except StepEnded:
            self._outbox.put((_DONE, None))
        except BaseException as error:  # handed to the caller, which raises it
            self._outbox.put((_FAILED, error))
        else:
            self._outbox.put((_DONE, result))
        finally:
            _current.running = None

    def _pause(self, call: NetworkCall) -> Any:
        self._outbox.put((_PAUSED, call))
        kind, value = self._inbox.get()
        if kind == "end":
            raise StepEnded
        return value


def mark_raised_by_the_step(error: BaseException) -> None:
    """Note that ``error`` came from the user's step itself (its code after the network call), not from the
    network's forward on a stage: the first step's checks then report it as it is, not as a cut that does not fit."""
    try:
        error.__dict__["_lightning_hybrid_in_step"] = True
    except (AttributeError, TypeError):  # an exception type without an instance dict: reported as a stage's failure
        pass


def raised_by_the_step(error: BaseException) -> bool:
    return bool(getattr(error, "__dict__", {}).get("_lightning_hybrid_in_step"))
