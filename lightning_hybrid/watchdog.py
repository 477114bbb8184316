"""Hang watchdog: a stuck rank ends the whole job within the collective timeout, with a report that names it.

A rank that is alive but not progressing (stopped, or deadlocked in its own code) leaves its peers waiting in a
collective until the process groups' timeout. Then the gloo ranks raise one by one, and NCCL's watchdog aborts,
without a word on which rank held the job up. This module adds the missing word and bounds the exit:

- **What each rank waits in.** torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, set here unless the user sized
  it) records every collective in C++, NCCL and gloo alike (DTensor's functional collectives and the user's own
  included): its per-group sequence numbers tell who has entered a collective and who has not. Under gloo it does not
  record ``send``/``recv``: the pipeline's transfers are told by the pipeline's stages themselves, as they hand their
  ops to torch's schedule (:mod:`lightning_hybrid.transfers`; nothing of torch is replaced to see them).
- **Heartbeats.** A daemon thread publishes that state to the job's store every few seconds (never per collective:
  nothing extra runs on the training path but the stages' bookkeeping of their transfers, a few dictionary operations
  per micro-batch).
- **On a timeout** (the collective raised, or this rank has waited past the timeout), the rank flags the hang in the
  store and reads every rank's heartbeat. The rank whose heartbeat stopped, or that has not entered the collective its
  peers wait in, is named; every rank prints the report (its own wait, each rank's collective and mesh dimension) and
  then exits within a grace period, also when its teardown would block (Lightning's SIGTERM handler broadcasts on the
  broken group, destroying a group can wait on a peer). Under NCCL torch also dumps the flight recorder on timeout
  (``TORCH_NCCL_DUMP_ON_TIMEOUT``), to be read with torch's ``fr_trace`` tool.

The store is the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``), reached over a connection of its own with a
short timeout. Under torchrun its agent hosts the store; under Lightning's own launcher rank 0 does, so when rank 0 is
the stuck rank no heartbeat can be read, and the report says so.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch.distributed as dist

from lightning_hybrid._torch_compat import flight_recorder_dumper
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.transfers import P2PObserver, observe_p2p_waits

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DEFAULT_TIMEOUT", "HangWatchdog", "configure_flight_recorder", "resolve_timeout"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The collective timeout of ``HybridStrategy`` (torch's own default is 30 minutes under gloo)."""

# flight-recorder entries kept per process: torch's recommendation for NCCL dumps; gloo's record is only read here
_TRACE_ENTRIES = {"nccl": 2000, "gloo": 256}
# the flight recorder's size, under torch's newer name first: torch reads both (the new one first) and warns on every
# rank that the old TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated (2.13); a buffer the user sized under either is kept
_BUFFER_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_BUFFER_SIZE = _BUFFER_SIZE_NAMES[0]
_GRACE_S = 10.0  # after the report, a rank still alive (teardown blocked) is ended
_STORE_TIMEOUT_S = 5.0
_runs = itertools.count()  # one key space per fit in a process (every rank starts the same fits in the same order)


def resolve_timeout(timeout: Union[timedelta, float, int, None]) -> timedelta:
    """The collective timeout as a ``timedelta``: ``HybridStrategy(timeout=...)`` takes a ``timedelta`` (as Lightning's
    ``DDPStrategy``) or seconds; None is the default of 10 minutes.

    Example:
        >>> resolve_timeout(90)
        datetime.timedelta(seconds=90)
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        seconds = -1.0
    if not seconds > 0:
        raise HybridConfigError(
            f"`timeout` must be a positive datetime.timedelta or a number of seconds, got {timeout!r}. It bounds how"
            " long a collective waits for a rank that does not come (default: 10 minutes)."
        )
    return timedelta(seconds=seconds)


def configure_flight_recorder(backend: str) -> dict[str, str]:
    """Turn on torch's flight recorder for the process groups about to be created, unless the user configured it:
    a ring buffer of the last collectives (``TORCH_FR_BUFFER_SIZE``) and, under NCCL, a dump of it on timeout
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``, to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, default ``/tmp/nccl_trace_rank_<rank>``).
    Must run before the process groups exist. Returns the variables it set."""
    wanted = {_BUFFER_SIZE: str(_TRACE_ENTRIES["nccl" if backend == "nccl" else "gloo"])}
    if backend == "nccl":
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    set_here = {}
    for name, value in wanted.items():
        if name == _BUFFER_SIZE and any(n in os.environ for n in _BUFFER_SIZE_NAMES):
            continue  # the user sized the buffer, under either name
        if name not in os.environ:
            os.environ[name] = set_here[name] = value
    return set_here


def heartbeat_interval(timeout: timedelta) -> float:
    """Seconds between heartbeats: a twentieth of the timeout, within [1, 5] s."""
    return min(max(timeout.total_seconds() / 20.0, 1.0), 5.0)


class HangWatchdog(P2PObserver):
    """Per-rank watchdog of one fit: heartbeats to the store, the hang report, and the bounded exit.

    Arguments:
        mesh: the run's ``("pipeline", "data", "tensor")`` device mesh (names each group's dimension).
        timeout: the process groups' timeout.
        backend: ``"gloo"`` or ``"nccl"``.

    Example:
        >>> # in the strategy, after the mesh exists (every rank):
        >>> # watchdog = HangWatchdog(mesh, timedelta(minutes=10), "gloo"); watchdog.start()
        >>> # ... on an exception: watchdog.on_exception(error); at teardown: watchdog.stop()
    """

    def __init__(self, mesh: DeviceMesh, timeout: timedelta, backend: str) -> None:
        self.timeout = timeout.total_seconds()
        self.interval = heartbeat_interval(timeout)
        self.backend = backend
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._mesh_names = tuple(mesh.mesh_dim_names or ())
        ranks = mesh.mesh.tolist()
        self._coordinates: dict[int, tuple[int, int, int]] = {}
        for p, plane in enumerate(ranks):
            for d, row in enumerate(plane):
                for t, r in enumerate(row):
                    self._coordinates[r] = (p, d, t)
        # this rank's groups, name -> [dimension, member ranks] (a group's name is the same on all its members); each
        # heartbeat carries them, so a report can name the groups of other ranks too
        self._groups: dict[str, list[Any]] = {dist.group.WORLD.group_name: ["world", list(range(self.world_size))]}
        for name in self._mesh_names:
            group = mesh.get_group(name)
            self._groups.setdefault(group.group_name, [name, dist.get_process_group_ranks(group)])
        self._prefix = f"lightning_hybrid/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_runs)}"
        # point-to-point transfers in progress, token -> (op, group name, peer, since, failed); a failed one stays
        # (the report names it) until the next transfer begins
        self._waits: dict[int, tuple[str, str, Optional[int], float, bool]] = {}
        self._tokens = itertools.count()
        self._failed = False
        self._last_state: dict[str, Any] = {"waits": []}
        self._store_error: Optional[str] = None
        self._store: Optional[Any] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reported = threading.Lock()
        self._done = False
        self._main_thread = threading.main_thread().ident
        self._main_frame: tuple[Any, float] = (None, time.time())  # (where the main thread is, since when)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Connect to the store, start observing the pipeline's transfers and the heartbeat thread."""
        self._store = _connect_store()
        observe_p2p_waits(self)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning-hybrid-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the heartbeats (teardown). After a hang report the bounded exit stays armed."""
        observe_p2p_waits(self, active=False)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + _STORE_TIMEOUT_S + 1.0)
        self._thread = None
        self._store = None

    def on_exception(self, error: BaseException) -> None:
        """Called with the exception that ends the fit: a failed or timed-out collective (or any error once another
        rank flagged a hang) triggers the report here, before the process can exit (the heartbeat thread might be
        between two beats)."""
        cause = _communication_error(error)
        if cause is not None:
            self._trigger(f"{type(cause).__name__}: {_first_line(cause)}")
        elif self._hang_flagged() is not None:
            self._trigger(f"rank {self._hang_flagged()} reported a hang")

    def _hang_flagged(self) -> Optional[str]:
        """The rank that flagged a hang in the store, if any."""
        try:
            if self._store is not None and self._store.check([self._key("hang")]):
                return self._store.get(self._key("hang")).decode()
        except Exception:
            pass
        return None

    # ------------------------------------------------------------------ point-to-point observer
    def p2p_wait_begin(self, op: str, group: Any, peer: Optional[int]) -> Any:
        token = next(self._tokens)
        name = (group if group is not None else dist.group.WORLD).group_name
        if self._failed:
            self._waits = {k: w for k, w in self._waits.items() if not w[4]}
            self._failed = False
        self._waits[token] = (op, name, peer, time.time(), False)
        return token

    def p2p_wait_end(self, token: Any, failed: bool) -> None:
        wait = self._waits.pop(token, None)
        if failed and wait is not None:
            self._waits[token] = (*wait[:4], True)
            self._failed = True

    # ------------------------------------------------------------------ heartbeat thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                state = self._publish()
                now = time.time()
                oldest = min((w["since"] for w in state["waits"]), default=None)
                if oldest is not None and now - oldest > self.timeout + self.interval and self._main_blocked(now):
                    self._trigger(f"this rank has waited {now - oldest:.0f} s (timeout {self.timeout:.0f} s)")
                elif (flagged := self._hang_flagged()) is not None:
                    self._trigger(f"rank {flagged} reported a hang")
            except Exception:  # the store may be gone at the end of a run: heartbeats are best effort
                pass
            if self._done:
                return

    def _main_blocked(self, now: float) -> bool:
        """Whether the main thread has stood on one line for longer than the timeout: the guard that a wait seen as
        pending (a collective the flight recorder has not retired yet) is really one the thread is blocked in."""
        frame = sys._current_frames().get(self._main_thread)
        where = (id(frame), frame.f_lasti) if frame is not None else None
        if where != self._main_frame[0]:
            self._main_frame = (where, now)
        return now - self._main_frame[1] > self.timeout

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _publish(self, state: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        if state is None and self._done:  # after the report, its state stays the published one
            return self._last_state
        state = state if state is not None else self._local_state()
        self._last_state = state
        if self._store is not None:
            try:
                self._store.set(self._key(f"rank{self.rank}"), json.dumps(state))
            except Exception:
                pass
        return state

    def _local_state(self) -> dict[str, Any]:
        """This rank's heartbeat: collectives not completed (flight recorder), per-group sequence numbers, and the
        point-to-point wait it is blocked in."""
        waits: list[dict[str, Any]] = []
        seqs: dict[str, list[int]] = {}
        last: Optional[dict[str, Any]] = None  # the newest collective, retired or not
        trace = _flight_recorder_dump(self.backend)
        if trace is not None:
            pg_names: dict[str, str] = {}
            for entry in trace.get("entries", []):
                name = str(entry["process_group"][0])
                pg_names[str(entry["pg_id"])] = name
                if not entry.get("retired") and not entry.get("is_p2p") and entry.get("state") != "completed":
                    op = str(entry.get("profiling_name", "?")).split(":")[-1]
                    seq = int(entry.get("collective_seq_id", 0))
                    since = int(entry.get("time_created_ns", 0)) / 1e9
                    waits.append({"op": op, "group": name, "seq": seq, "since": since})
                if not entry.get("is_p2p"):
                    last = {
                        "op": str(entry.get("profiling_name", "?")).split(":")[-1],
                        "group": name,
                        "seq": int(entry.get("collective_seq_id", 0)),
                        "since": int(entry.get("time_created_ns", 0)) / 1e9,
                    }
            for pg_id, status in trace.get("pg_status", {}).items():
                if pg_id in pg_names:
                    seqs[pg_names[pg_id]] = [
                        int(status.get("last_enqueued_collective", -1)),
                        int(status.get("last_completed_collective", -1)),
                    ]
        for op, group, peer, since, failed in list(self._waits.values()):
            waits.append({"op": op, "group": group, "peer": peer, "since": since, "failed": failed})
        return {
            "t": time.time(),
            "host": _HOST,
            "pid": os.getpid(),
            "waits": waits,
            "last": last,
            "seqs": seqs,
            "groups": self._groups,
        }

    # ------------------------------------------------------------------ the report
    def _trigger(self, reason: str) -> None:
        if not self._reported.acquire(blocking=False):
            return  # reported already (from the other thread)
        self._done = True
        try:
            store = self._store
            states: Optional[dict[int, Optional[dict[str, Any]]]] = None
            self._store_error = "no store address (MASTER_ADDR/MASTER_PORT)" if store is None else None
            if store is not None:
                try:
                    if not store.check([self._key("hang")]):
                        store.set(self._key("hang"), str(self.rank))
                    self._publish(self._state_at_failure())
                    keys = [self._key(f"rank{r}") for r in range(self.world_size)]
                    present = [store.check([k]) for k in keys]
                    values = store.multi_get([k for k, ok in zip(keys, present) if ok])
                    it = iter(values)
                    states = {r: (json.loads(next(it)) if ok else None) for r, ok in enumerate(present)}
                except Exception as error:
                    states, self._store_error = None, _first_line(error)
            if states is None:
                states, answered = {self.rank: self._state_at_failure()}, False
            else:
                answered = True
            report = self.report(reason, states, store_answered=answered)
            sys.stderr.write(report + "\n")
            if answered and self._named_stuck_is_me(states):
                frame = sys._current_frames().get(self._main_thread)
                if frame is not None:
                    stack = "".join(traceback.format_stack(frame))
                    sys.stderr.write(f"[rank {self.rank}] this rank's main thread is at:\n{stack}")
            sys.stderr.flush()
        finally:
            # bounded exit: if the normal exception path (Lightning's teardown, destroying the groups) blocks on a
            # peer that never answers, end the process; faulthandler's timer runs without the GIL
            faulthandler.dump_traceback_later(_GRACE_S, exit=True)

    def _state_at_failure(self) -> dict[str, Any]:
        """The fresh state, plus the waits of the last heartbeat that are gone since: after a collective raised, the
        flight recorder has retired it, yet it is the one this rank was waiting in."""
        state = self._local_state()
        current = {(w["op"], w["group"], w.get("seq"), w.get("peer"), w["since"]) for w in state["waits"]}
        for w in self._last_state["waits"]:
            if (w["op"], w["group"], w.get("seq"), w.get("peer"), w["since"]) not in current:
                state["waits"].append({**w, "failed": True})
        if not state["waits"] and state["last"] is not None:
            # failed between two heartbeats: the newest collective (already retired by the failure) is the one
            state["waits"].append({**state["last"], "failed": True})
        return state

    def _named_stuck_is_me(self, states: Optional[dict[int, Optional[dict[str, Any]]]]) -> bool:
        if not states:
            return False
        groups = _merged_groups(states, self._groups)
        return self.rank in analyse(states, groups, time.time(), self._stale_after())[0]

    def _stale_after(self) -> float:
        return 3 * self.interval + 2.0

    def report(self, reason: str, states: dict[int, Optional[dict[str, Any]]], *, store_answered: bool = True) -> str:
        """The hang report: the stuck rank(s), then what each rank waits in, with its mesh dimension."""
        now = time.time()
        groups = _merged_groups(states, self._groups)
        stuck, behind = analyse(states, groups, now, self._stale_after())
        head = f"[rank {self.rank}] lightning-hybrid watchdog (collective timeout {self.timeout:.0f} s): {reason}."
        lines = [head]
        if not store_answered:
            host = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            lines.append(
                f"  The job's store at {host[0]}:{host[1]} does not answer ({self._store_error}), so other ranks'"
                " heartbeats cannot be read. Under Lightning's own launcher rank 0 hosts the store: rank 0 is then"
                " likely the stuck rank."
            )
        for r in sorted(stuck):
            state = states.get(r)
            if state is None:
                why = "no heartbeat at all"
            elif _exited(state):
                why = f"its process (pid {state['pid']} on {state['host']}) has exited"
            elif now - state["t"] > self._stale_after():
                why = f"no heartbeat for {now - state['t']:.0f} s (stopped, killed, or holding the GIL)"
            else:
                why = "alive but not in the collective its peers wait in (stuck in its own code?)"
            lines.append(f"  Stuck rank: {r} ({self._where(r)}): {why}.")
        if store_answered and not stuck:
            lines.append("  No rank is behind: the ranks wait on each other (a cycle of point-to-point waits?).")
        lines.append("  Each rank waits in:")
        for r in range(self.world_size):
            described = self._describe(states.get(r), groups, now, behind.get(r))
            lines.append(f"    rank {r} ({self._where(r)}): {described}")
        lines.append(f"  This rank exits within {_GRACE_S:.0f} s.")
        return "\n".join(f"[rank {self.rank}] {line}" if i else line for i, line in enumerate(lines))

    def _where(self, rank: int) -> str:
        p, d, t = self._coordinates.get(rank, (-1, -1, -1))
        return f"pipeline {p}, data {d}, tensor {t}"

    def _describe(
        self, state: Optional[dict[str, Any]], groups: dict[str, list[Any]], now: float, behind: Optional[list[int]]
    ) -> str:
        if state is None:
            return "unknown (no heartbeat)"
        wait = _oldest(state)
        stale = now - state["t"] > self._stale_after()
        if wait is None:
            text = "no collective (running its own code)"
        else:
            dim = groups.get(wait["group"], ["another group"])[0]
            if "peer" in wait:
                direction = "from" if wait["op"] == "recv" else "to"
                text = f"{wait['op']} {direction} rank {wait['peer']} on the {dim} dimension"
            else:
                text = f"{wait['op']} #{wait['seq']} on the {dim} dimension"
            text += f" for {state['t'] - wait['since']:.0f} s" + (", then failed" if wait.get("failed") else "")
            if behind:
                text += f" (not entered by rank {', '.join(map(str, behind))})"
        if stale:
            text = f"NOT RESPONDING for {now - state['t']:.0f} s; last seen in {text}"
        return text


def _merged_groups(states: dict[int, Optional[dict[str, Any]]], own: dict[str, list[Any]]) -> dict[str, list[Any]]:
    groups = dict(own)
    for state in states.values():
        groups.update((state or {}).get("groups", {}))
    return groups


def analyse(
    states: dict[int, Optional[dict[str, Any]]],
    groups: dict[str, list[Any]],
    now: float,
    stale_after: float,
) -> tuple[set[int], dict[int, list[int]]]:
    """(stuck ranks, {waiting rank: ranks it waits for}) from every rank's heartbeat.

    A rank waiting in a collective waits for the group's members that have not entered it (their last enqueued
    sequence number on that group is lower); a rank waiting in a point-to-point transfer waits for its peer. Following
    these edges ends at the stuck ranks: one whose heartbeat stopped, or one that is alive but in no collective.
    """
    alive = {r: s is not None and now - s["t"] <= stale_after and not _exited(s) for r, s in states.items()}
    waits_for: dict[int, list[int]] = {}
    for r, state in states.items():
        wait = _oldest(state) if state is not None and alive[r] else None
        if wait is None:
            continue
        if "peer" in wait:
            waits_for[r] = [wait["peer"]] if wait["peer"] is not None else []
            continue
        members = groups.get(wait["group"], ["", []])[1]
        late = []
        for m in members:
            other = states.get(m)
            if m == r:
                continue
            if other is None or other.get("seqs", {}).get(wait["group"], [-1, -1])[0] < wait["seq"]:
                late.append(m)
        waits_for[r] = late
    stuck: set[int] = set()
    for start in waits_for:
        seen, todo = {start}, list(waits_for[start])
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            if not alive.get(r, False) or r not in waits_for:
                stuck.add(r)
            else:
                todo.extend(waits_for[r])
    if not stuck:  # e.g. a rank stopped inside the collective (it entered it): the silent one is the stuck one
        stuck = {r for r, ok in alive.items() if not ok}
    return stuck, {r: [m for m in late if m in stuck] for r, late in waits_for.items()}


_HOST = socket.gethostname()


def _exited(state: dict[str, Any]) -> bool:
    """Whether a rank's process, on this host, no longer exists (a killed rank's last heartbeat is still fresh)."""
    if state.get("host") != _HOST or not state.get("pid"):
        return False
    try:
        os.kill(int(state["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:  # a zombie, not yet reaped by its launcher, has exited too
        with open(f"/proc/{int(state['pid'])}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return False


def _oldest(state: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not state or not state.get("waits"):
        return None
    return min(state["waits"], key=lambda w: w["since"])


def _flight_recorder_dump(backend: str) -> Optional[dict[str, Any]]:
    """This process's flight-recorder record (JSON), or None where this torch has no dump for the backend."""
    dump = flight_recorder_dumper(backend)
    if dump is None:
        return None
    try:
        return json.loads(dump(True, True))
    except Exception:
        return None


def _connect_store() -> Optional[Any]:
    """A connection of its own to the job's store, with a short timeout (a stuck store host must not block the
    report); None where the job has no TCP store address."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S), wait_for_workers=False
        )
    except Exception:
        return None


def _communication_error(error: Optional[BaseException]) -> Optional[BaseException]:
    """The failed or timed-out collective in ``error``'s chain (the pipeline re-raises it wrapped), or None."""
    markers = ("Timed out", "timed out", "Connection closed", "Connection reset", "gloo", "NCCL", "Watchdog")
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, getattr(dist, "DistError", ())) or (
            isinstance(error, RuntimeError) and any(m in str(error) for m in markers)
        ):
            return error
        error = error.__cause__ or error.__context__
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
