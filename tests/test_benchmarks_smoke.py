"""The benchmark scripts in benchmarks/ run end to end at tiny sizes (they are not run for real in the test suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the smoke run launches 4 processes once and trains 3 schedules for 2 steps each: ~1 minute on a busy 2-core machine,
# almost all of it process start-up; the limits leave room for a slow machine but stop a hang
GROUP_TIMEOUT = 300
SUBPROCESS_TIMEOUT = 360


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 60)
def test_pipeline_bubble_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pipeline_bubble.py"), "--smoke", "--out-dir", str(tmp_path),
           "--timeout", str(GROUP_TIMEOUT)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    results = json.loads((tmp_path / "pipeline_bubble.json").read_text())
    assert results["smoke"] is True
    assert set(results["schedules"]) == {"gpipe", "1f1b", "interleaved_1f1b"}
    for name, summary in results["schedules"].items():
        assert len(summary["per_rank"]) == 4, name
        for rank in summary["per_rank"]:
            assert 0.0 <= rank["median_bubble"] < 1.0, (name, rank)

    m = results["layout"]["num_microbatches"]
    for name, stages_per_rank in (("1f1b", 1), ("interleaved_1f1b", 2)):
        trace = json.loads((tmp_path / f"pipeline_{name}_p4_m8.json").read_text())
        actions = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "B", "I", "W")]
        assert {e["pid"] for e in actions} == {0, 1, 2, 3}, f"{name}: not every rank has events"
        for rank in range(4):
            mine = [e for e in actions if e["pid"] == rank]
            # every micro-batch goes forward and backward once through each of the rank's stages
            assert sum(e["cat"] == "F" for e in mine) == m * stages_per_rank, (name, rank)
            assert sum(e["cat"] == "B" for e in mine) == m * stages_per_rank, (name, rank)
            assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine), (name, rank)
        assert (tmp_path / f"pipeline_{name}_p4_m8.png").stat().st_size > 0
    # results and figures went to the directory given, not into the repository
    assert str(tmp_path) in proc.stdout
