"""Issue: reliability. A stuck rank ends the job with a report naming it; torchrun restarts a job and it resumes.

Hang: 8 processes at 2x2x2 (``torchrun``, ``tests/hang_fit.py``) train with a 20 s collective timeout; at step 3 the
test SIGSTOPs rank 5 (pipeline 1, data 0, tensor 1). Every other rank must exit within timeout + 30 s, each printing
the watchdog's report: the stuck rank, and the collective and mesh dimension each rank waits in. Before the watchdog,
the 7 others were still waiting 100 s after the SIGSTOP, with no message (torch's default timeout is 30 minutes).

Restart: the shipped ``cli_configs/restart.yaml`` under ``torchrun --max-restarts 2 --no-python lightning-hybrid fit``
on 2 processes, checkpointing every 5 steps; rank 1 SIGKILLs itself just before step 9 of the first attempt
(``tests/restart_probe.py``). torchrun restarts the job, which resumes from the newest checkpoint (step 5) and
finishes; the steps lost are those after that checkpoint (6, 7 and 8).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20
STOP_RANK = 5  # pipeline 1, data 0, tensor 1 in the 2x2x2 mesh


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def _first_error(log: str) -> str:
    """The log from the first traceback or watchdog report on (the agent's summary at the end says only which rank
    failed), and its end."""
    starts = [i for i in (log.find("Traceback"), log.find("lightning-hybrid watchdog")) if i >= 0]
    return (log[min(starts) : min(starts) + 4000] + "\n...\n" if starts else "") + log[-2000:]


@pytest.mark.timeout(900)
def test_sigstopped_rank_ends_the_job_with_a_report_naming_it(tmp_path: Path) -> None:
    world = 8
    spec = {"dir": str(tmp_path), "stop_rank": STOP_RANK, "stop_at": 3, "timeout": TIMEOUT_S,
            "strategy": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1}}  # fmt: skip
    log = (tmp_path / "log.txt").open("w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(ROOT / "tests" / "hang_fit.py"), json.dumps(spec)]  # fmt: skip
    agent = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    stopped, exits = None, {}
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "ready").exists():
            log_text = (tmp_path / "log.txt").read_text()
            assert agent.poll() is None and time.monotonic() < deadline, _first_error(log_text)
            time.sleep(0.1)
        stopped = int((tmp_path / "ready").read_text())
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        pids = {r: int((tmp_path / f"pid.{r}").read_text()) for r in range(world) if r != STOP_RANK}
        while len(exits) < len(pids) and time.monotonic() - t0 < TIMEOUT_S + 60:
            for r, pid in pids.items():
                if r not in exits and _exited(pid):
                    exits[r] = time.monotonic() - t0
            time.sleep(0.1)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
        try:
            agent.wait(timeout=60)
        finally:
            agent.kill()
            log.close()
    text = (tmp_path / "log.txt").read_text()
    print(f"exit seconds after SIGSTOP, per rank: { {r: round(s, 1) for r, s in sorted(exits.items())} }")
    assert len(exits) == world - 1, f"ranks still running {TIMEOUT_S + 60} s after the SIGSTOP: {exits}\n{text[-4000:]}"
    assert max(exits.values()) <= TIMEOUT_S + 30, exits
    for r in range(world):
        if r == STOP_RANK:
            continue
        mine = [line for line in text.splitlines() if line.startswith(f"[rank {r}] ")]
        assert any("lightning-hybrid watchdog" in line for line in mine), f"rank {r} printed no report:\n{text[-4000:]}"
        report = "\n".join(mine)
        assert f"Stuck rank: {STOP_RANK} (pipeline 1, data 0, tensor 1)" in report, report
        assert not re.search(r"Stuck rank: (?!5 )", report), report  # no other rank is named
        # the collective each rank waits in, and its mesh dimension
        waits = re.findall(
            r"    rank (\d) \(.*?\): (?:NOT RESPONDING.*?last seen in )?(\w+) .*?on the (\w+) dimension", report
        )
        assert {int(w[0]) for w in waits} >= set(pids), report
        assert {w[2] for w in waits} <= {"pipeline", "data", "tensor", "world"}, report


@pytest.mark.timeout(900)
def test_torchrun_restarts_a_killed_job_and_it_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    every, kill_at, max_steps = 5, 9, 10
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "2", "--no-python", "lightning-hybrid", "fit",
           "--config", str(ROOT / "cli_configs" / "restart.yaml"), f"--trainer.max_steps={max_steps}",
           "--trainer.logger=false", "--trainer.callbacks+=tests.restart_probe.StepLog"]  # fmt: skip
    # the recipe's variable: without it the restarted ranks can read the previous attempt's gloo addresses from the
    # agent's store and fail to connect (pytorch/pytorch#135712)
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800)
    log = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(log)
    assert proc.returncode == 0, log[-5000:]
    steps = [tuple(map(int, line.split())) for line in (tmp_path / "steps.rank0").read_text().splitlines()]
    attempts = sorted({a for a, _ in steps})
    first = [s for a, s in steps if a == attempts[0]]
    last = [s for a, s in steps if a == attempts[-1]]
    assert first == list(range(1, kill_at)), steps  # rank 1 died before step 9: rank 0 completed 1..8
    assert attempts == [0, 1], steps  # one restart: the restarted job itself came up at once
    newest = (kill_at - 1) // every * every  # the newest checkpoint written before the kill: step 5
    assert last[0] == newest + 1 and last[-1] == max_steps, steps  # resumed right after it, and finished
    lost = first[-1] - newest
    print(f"steps lost to the kill: {lost} (checkpoint every {every}); attempts {attempts}")
    assert lost <= every - 1
    assert "Restoring states from the checkpoint path at" in log and "last.ckpt" in log, log[-3000:]


# ---------------------------------------------------------------- single process: the argument and the analysis
@pytest.mark.parametrize(("given", "seconds"), [(None, 600.0), (20, 20.0), (2.5, 2.5), (timedelta(minutes=3), 180.0)])
def test_timeout_takes_a_timedelta_or_seconds(given: Any, seconds: float) -> None:
    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.watchdog import resolve_timeout

    assert resolve_timeout(given).total_seconds() == seconds
    assert HybridStrategy(timeout=given)._options.timeout.total_seconds() == seconds


@pytest.mark.parametrize("given", [0, -5, "10m", True, timedelta(0)])
def test_bad_timeout_names_the_parameter_the_value_and_the_fix(given: Any) -> None:
    from lightning_hybrid import HybridConfigError, HybridStrategy

    with pytest.raises(HybridConfigError, match=r"`timeout` must be a positive datetime\.timedelta or a number of"):
        HybridStrategy(timeout=given)


def _beat(t: float, waits: list[dict[str, Any]], seqs: dict[str, list[int]]) -> dict[str, Any]:
    return {"t": t, "host": "elsewhere", "pid": 1, "waits": waits, "seqs": seqs}


def test_analysis_follows_waits_to_the_rank_that_is_behind() -> None:
    """Rank 0 waits in a tensor all-reduce with rank 1; rank 1 waits to receive from rank 3 (pipeline); rank 3 is
    alive but has not entered the data all-reduce rank 2 waits in, and waits in nothing: rank 3 is the stuck one."""
    from lightning_hybrid.watchdog import analyse

    groups = {"t01": ["tensor", [0, 1]], "d23": ["data", [2, 3]], "p13": ["pipeline", [1, 3]]}
    now = 100.0
    states = {
        0: _beat(now, [{"op": "all_reduce", "group": "t01", "seq": 7, "since": 50}], {"t01": [7, 6]}),
        1: _beat(now, [{"op": "recv", "group": "p13", "peer": 3, "since": 55}], {"t01": [6, 6]}),
        2: _beat(now, [{"op": "all_reduce", "group": "d23", "seq": 4, "since": 52}], {"d23": [4, 3]}),
        3: _beat(now, [], {"d23": [3, 3]}),
    }
    stuck, behind = analyse(states, groups, now, stale_after=5.0)
    assert stuck == {3} and behind[2] == [3] and behind[1] == [3]
    # the same with rank 3 silent (stopped): still rank 3, also when it had entered the collective before stopping
    states[3] = _beat(now - 30, [{"op": "all_reduce", "group": "d23", "seq": 4, "since": 69}], {"d23": [4, 3]})
    assert analyse(states, groups, now, stale_after=5.0)[0] == {3}
