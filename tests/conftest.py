"""Launching scenarios in shared process groups (start-up is the expensive part on CPU)."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


class LaunchResult:
    def __init__(self, out_dir: Path, log: str, returncode: int) -> None:
        self.out_dir, self.log, self.returncode = out_dir, log, returncode

    def get(self, name: str) -> dict[str, Any]:
        path = self.out_dir / f"{name}.pt"
        if path.exists():
            return torch.load(path, weights_only=False)
        error = self.out_dir / f"{name}.error"
        detail = error.read_text() if error.exists() else f"(not run: the group stopped earlier)\n{self.log[-6000:]}"
        pytest.fail(f"scenario {name} failed:\n{detail}")

    def expected_errors(self, name: str) -> list[str]:
        return [p.read_text() for p in sorted(self.out_dir.glob(f"{name}.rank*.expected"))]


def console_script(*args: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the installed ``lightning-hybrid`` command as a user does (a subprocess of the console script)."""
    import shutil

    scripts = str(Path(sys.executable).parent)  # the interpreter's own scripts folder, where pip put the command
    command = shutil.which("lightning-hybrid") or shutil.which("lightning-hybrid", path=scripts)
    assert command, "the `lightning-hybrid` console script is not installed (pip install -e .)"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def assert_clean_exit(proc: subprocess.CompletedProcess) -> None:
    """Exit status 0, and nothing the console script printed of a return value (``sys.exit(obj)`` prints ``obj``)."""
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    assert "object at 0x" not in proc.stderr, proc.stderr[-3000:]


def launch(
    world: int,
    scenarios: list[dict[str, Any]],
    out_dir: Path,
    timeout: float,
    niceness: int = 0,
    environ: Optional[dict[str, str]] = None,
) -> LaunchResult:
    """Run ``scenarios`` in one group of ``world`` CPU processes (forked with ``torchrun``'s worker environment:
    tests/fork_launch.py), with a hard timeout (``niceness``: the group's scheduling priority below this process's,
    for a launch running behind other tests; ``environ``: the group's environment, this process's by default). A
    test that needs a variable in its group passes it here: setting it in ``os.environ`` would also reach a shared
    launch starting meanwhile in the background (a kill-in-save variable set that way SIGKILLed a rank of the
    8-process launch, and 86 tests failed with it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "spec.json"
    # runs through LightningCLI, and the tuner-and-loggers runs, last: something outside Python's reach keeps each
    # CLI object (and with it its trainer, module and the groups of their mesh: 9 gloo threads a rank) alive after
    # the command returns, and the same for the W&B and TensorBoard runs; idle gloo threads made every later
    # scenario of the launch cost up to 1.8x the CPU
    spec.write_text(json.dumps(sorted(scenarios, key=keeps_its_groups)))
    environ = dict(os.environ if environ is None else environ)
    env = {**environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{environ.get('PYTHONPATH', '')}"}
    # the ranks are forked from one interpreter that imported torch and Lightning (tests/fork_launch.py), with
    # torchrun's worker environment: start-up was ~10 CPU-s per rank
    cmd = [sys.executable, str(ROOT / "tests" / "fork_launch.py"), str(world), "tests.worker:main", str(spec),
           str(out_dir)]  # fmt: skip
    # a session of its own: a timeout or the end of the test session kills the agent and its ranks together
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
    )  # fmt: skip
    RUNNING.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
        return LaunchResult(out_dir, out + err, proc.returncode)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return LaunchResult(out_dir, f"TIMEOUT after {timeout}s (a hang)\n{out}{err}", -1)
    finally:
        RUNNING.discard(proc)


def keeps_its_groups(scenario: dict[str, Any]) -> bool:
    """Whether a scenario's process groups outlive it (see ``launch``): LightningCLI and the W&B/TensorBoard runs,
    DeepSpeed's engines (DeepSpeed keeps its groups in module globals) and the imports of their checkpoints, which a
    stable sort keeps after them."""
    return scenario.get("runner") in ("cli", "feature_extras") or "deepspeed_source" in scenario or str(
        scenario.get("resume_from", "")
    ).startswith("ds-source")


# launches in flight, killed (with their ranks) if the session ends first
RUNNING: set[subprocess.Popen] = set()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


# Scenarios of every test module, by world size: each world is launched once per session (process start-up of torch
# and Lightning is the expensive part on CPU). Modules register at import (collection).
SHARED: dict[int, list[dict[str, Any]]] = {}
# the worlds each test module registered scenarios in: a session launches those of the modules it runs tests of
REGISTERED_BY: dict[str, set[int]] = {}
# The launches run behind the other tests, at a lower priority: the tests that read them run last (see
# pytest_collection_modifyitems), and the launches use the CPU the tests that start their own processes leave idle
# while they start, wait or exit (a quarter of two cores, measured); the shared launches alone keep both cores busy.
_BACKGROUND_NICENESS = 10
# seconds a shared launch may take per scenario (8 CPU processes on 2 cores; most scenarios take 5-20 s)
_SECONDS_PER_SCENARIO = 60


# `pytest --scenarios PATTERN[,PATTERN...]`: launch only the scenarios whose names match (fnmatch), and deselect the
# parametrized tests that read another one; tests that name their scenarios inside are selected with -k as usual. CI
# runs the oldest supported torch this way, on a subset.
SCENARIO_PATTERNS: list[str] = []


def launched(name: str) -> bool:
    """Whether the session launches the scenario ``name`` (all of them unless ``--scenarios`` narrows it)."""
    return not SCENARIO_PATTERNS or any(fnmatch.fnmatchcase(name, p) for p in SCENARIO_PATTERNS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--scenarios",
        default="",
        help="comma-separated name patterns: launch only these multi-process scenarios (e.g. 'nanogpt-tp2,pp2-*')",
    )
    parser.addoption(
        "--scenario-timings",
        action="store_true",
        help="print each shared launch's scenarios with their wall time and CPU time summed over the ranks",
    )


# the shared launches of this session, by world size, for the timing summary
LAUNCHED: dict[int, LaunchResult] = {}


def scenario_timings(out_dir: Path) -> list[tuple[str, float, float, int]]:
    """(scenario, wall seconds (slowest rank), CPU seconds (all ranks, all threads), threads per rank after it) from
    the worker's per-rank timing files, in launch order; "(start-up)" is the imports before the first scenario."""
    rows: dict[str, list[float]] = {}
    for path in sorted(out_dir.glob("timings.rank*.tsv")):
        for line in path.read_text().splitlines()[1:]:
            name, wall, cpu, threads, _rss = line.split("\t")
            row = rows.setdefault(name, [0.0, 0.0, 0])
            row[0], row[1], row[2] = max(row[0], float(wall)), row[1] + float(cpu), max(row[2], int(threads))
    return [(name, wall, cpu, int(threads)) for name, (wall, cpu, threads) in rows.items()]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not config.getoption("--scenario-timings"):
        return
    for world, result in sorted(LAUNCHED.items()):  # this copy's: the fixture below is this copy's too
        rows = scenario_timings(result.out_dir)
        wall, cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
        terminalreporter.section(f"shared launch of {world} processes: {wall:.0f} s wall, {cpu:.0f} CPU-s")
        for name, wall, cpu, threads in sorted(rows, key=lambda r: -r[2]):
            terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:7.1f} s  {threads:4d} threads  {name}")


def pytest_configure(config: pytest.Config) -> None:
    # pytest may import this file as `conftest` while test modules import `tests.conftest`: set both copies
    import tests.conftest as registry

    patterns = [p.strip() for p in config.getoption("--scenarios").split(",") if p.strip()]
    SCENARIO_PATTERNS[:] = registry.SCENARIO_PATTERNS[:] = patterns


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--scenarios``: deselect the tests parametrized by a scenario (or its name) the session leaves out. Then
    the tests that read the shared launches go last (in their order), so the launches can run behind the others."""
    from tests.conftest import REGISTERED_BY as registrars
    from tests.conftest import SHARED as registered

    if SCENARIO_PATTERNS:
        known = {s["name"] for group in registered.values() for s in group}

        def reads_left_out(item: pytest.Item) -> bool:
            params = getattr(getattr(item, "callspec", None), "params", {})
            names = [v.get("name") if isinstance(v, dict) else v for v in params.values() if isinstance(v, (dict, str))]
            return any(isinstance(n, str) and n in known and not launched(n) for n in names)

        left_out = [item for item in items if reads_left_out(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item not in left_out]
    readers = [item for item in items if "shared_groups" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in set(readers)] + readers
    worlds = {w for item in readers for w in registrars.get(getattr(item.module, "__name__", ""), ())}
    import tests.conftest as registry  # both copies, as pytest_configure sets them

    needed = sorted(w for w in worlds if any(launched(s["name"]) for s in registered.get(w, [])))
    NEEDED_WORLDS[:] = registry.NEEDED_WORLDS[:] = needed


# the worlds the selected tests read, smallest first: launched in that order behind the other tests
NEEDED_WORLDS: list[int] = []


def share(world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``scenarios`` to the session's launch of ``world`` processes; returns them."""
    group = SHARED.setdefault(world, [])
    REGISTERED_BY.setdefault(sys._getframe(1).f_globals.get("__name__", ""), set()).add(world)
    taken = {s["name"]: s for s in group}
    # a module imported twice (as a test file and by another module) registers the same scenarios again: keep one
    clashes = [s["name"] for s in scenarios if s["name"] in taken and taken[s["name"]] != s]
    assert not clashes, f"scenario names must be unique across test modules: {clashes}"
    group.extend(s for s in scenarios if s["name"] not in taken)
    return scenarios


class _BackgroundLaunches:
    """The session's shared launches, one after another in a thread, each at a lower priority than the tests; a
    world the thread does not launch is launched when first read."""

    def __init__(self, base: Path) -> None:
        self.base = base
        # the environment as the session started: what a test sets in os.environ for a while (monkeypatch.setenv,
        # ...) must not reach a launch that happens to start meanwhile
        self.environ = dict(os.environ)
        self.results: dict[int, Future] = {}
        self._lock = threading.Lock()

    def start(self, worlds: list[int]) -> None:
        threading.Thread(target=self._run_all, args=(worlds,), daemon=True, name="shared-launches").start()

    def get(self, world: int) -> LaunchResult:
        future, mine = self._claim(world)
        if mine:
            self._run(world, future, niceness=0)
        return future.result()

    def _claim(self, world: int) -> tuple[Future, bool]:
        """The world's result, and whether the caller is the one to launch it."""
        with self._lock:
            if world in self.results:
                return self.results[world], False
            future = self.results[world] = Future()
            return future, True

    def _run_all(self, worlds: list[int]) -> None:
        for world in worlds:
            future, mine = self._claim(world)
            if mine:
                self._run(world, future, niceness=_BACKGROUND_NICENESS)

    def _run(self, world: int, future: Future, niceness: int) -> None:
        # pytest may import this file as `conftest` while test modules import `tests.conftest`: read the copy they
        # registered into
        from tests.conftest import SHARED as registered

        try:
            scenarios = [s for s in registered[world] if launched(s["name"])]
            timeout = max(900, _SECONDS_PER_SCENARIO * len(scenarios))
            result = launch(world, scenarios, self.base / f"shared{world}", timeout, niceness, self.environ)
            LAUNCHED[world] = result
            future.set_result(result)
        except BaseException as error:  # a test that reads it reports it
            future.set_exception(error)


@pytest.fixture(scope="session", autouse=True)
def _shared_launches(tmp_path_factory: pytest.TempPathFactory):
    """Starts the session's shared launches behind the first test (every world the selected tests read)."""
    launches = _BackgroundLaunches(tmp_path_factory.mktemp("shared"))
    from tests.conftest import NEEDED_WORLDS as needed

    launches.start(list(needed))
    yield launches
    for proc in list(RUNNING):  # the session ended before a launch did (-x, ^C): no rank outlives it
        _kill_group(proc)


@pytest.fixture(scope="session")
def shared_groups(_shared_launches: _BackgroundLaunches):
    """``get(world)``: the results of every registered scenario of that world, launched once (behind the tests that
    do not read them)."""
    return _shared_launches.get


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (per tensor; robust to elements that are exactly zero)."""
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    return (actual - expected).norm().item() / (denom if denom > 0 else 1.0)
