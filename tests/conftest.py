"""Launching scenarios in shared process groups (start-up is the expensive part on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def launch(world: int, scenarios: list[dict[str, Any]], out_dir: Path, timeout: float) -> LaunchResult:
    """Run ``scenarios`` in one ``torchrun`` group of ``world`` CPU processes, with a hard timeout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "spec.json"
    spec.write_text(json.dumps(scenarios))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--standalone",
           str(ROOT / "tests" / "worker.py"), str(spec), str(out_dir)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return LaunchResult(out_dir, proc.stdout + proc.stderr, proc.returncode)
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return LaunchResult(out_dir, f"TIMEOUT after {timeout}s (a hang)\n{log}", -1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (per tensor; robust to elements that are exactly zero)."""
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    return (actual - expected).norm().item() / (denom if denom > 0 else 1.0)
