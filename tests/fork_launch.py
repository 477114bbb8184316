"""Start one group of N CPU ranks of a test worker (``tests/worker.py``'s ``main`` and the like) by forking them from
one interpreter that has imported torch, Lightning and the package, instead of ``torchrun`` starting N interpreters
that each import them again.

The imports are about 10 CPU-seconds a process on the 2-core test machine (``import lightning`` alone is 8 s, most of
it torchmetrics' eager imports of SciPy, transformers and matplotlib), and the suite's launches start about 40
ranks: that start-up was a tenth of the suite's CPU time. What the ranks run is unchanged: each gets the
environment ``torchrun`` gives its workers (so Lightning picks the same cluster environment), rank 0 hosts the
rendezvous store as under ``init_process_group("env://")``, and the group ends as ``torchrun`` ends one: the first
rank to fail stops the others, and the launcher exits with its code. The launch of a user's script is tested where
it matters, with ``torchrun`` and Lightning's own launcher (tests/test_teardown.py, tests/test_hang_restart.py).

Usage: python tests/fork_launch.py N MODULE:FUNCTION ARGS...  (the function reads ``sys.argv[1:]``, as a script
``torchrun`` started would: e.g. ``tests.worker:main SPEC.json OUT_DIR``)
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# after the first failure, how long the other ranks get to leave on SIGTERM before SIGKILL (torchrun waits 30 s)
_GRACE_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, target: Any, args: list[str]) -> None:
    """The forked rank: torchrun's worker environment, then the worker; never returns."""
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"fork-{os.getppid()}",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    })  # fmt: skip
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store: there is no agent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [sys.modules[target.__module__].__file__, *args]
    code = 0
    try:
        target()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # what an interpreter's exit would run (the strategy's handler destroys its process groups), without
        # finalizing the interpreter copied from the launcher
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(pids: dict[int, int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        pids.pop(pid, None) if pid else time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main() -> int:
    world, (module, function), args = int(sys.argv[1]), sys.argv[2].split(":"), sys.argv[3:]
    target = getattr(importlib.import_module(module), function)  # torch, Lightning, the package: imported once here
    # a thread holding a lock at fork would leave it held in every rank: the imports must not have started any
    assert threading.active_count() == 1, f"threads before the fork: {threading.enumerate()}"
    niceness = os.nice(0)
    if niceness > 0:
        # The launch runs in a session of its own (the suite starts it so), and with autogroup scheduling CPU time
        # is shared between sessions first: its plain nice would not yield to the tests in front. The session's
        # group takes the same nice (best effort: only Linux has /proc/self/autogroup).
        try:
            Path("/proc/self/autogroup").write_text(str(niceness))
        except OSError:
            pass
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank_main(rank, world, port, target, args)
        pids[pid] = rank
    first_failure = 0
    while pids:
        pid, status = os.waitpid(-1, 0)
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"fork_launch: rank {rank} (pid {pid}) failed (exitcode: {code}); stopping the rest", file=sys.stderr)
            first_failure = code
            _stop(pids)
            break
    return first_failure if first_failure >= 0 else 128 - first_failure


if __name__ == "__main__":
    sys.exit(main())
