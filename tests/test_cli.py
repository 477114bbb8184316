"""The lightning-hybrid command (LightningCLI): config, overrides, and a real 3D run of the quick-start config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lightning_hybrid", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_print_config_applies_command_line_overrides() -> None:
    proc = _cli("fit", "--config", "cli_configs/cpu_quickstart.yaml", "--trainer.strategy.init_args.zero_stage=3",
                "--trainer.strategy.init_args.pipeline_schedule=gpipe", "--print_config", timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load(proc.stdout)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hybrid.HybridStrategy"
    assert strategy["init_args"]["zero_stage"] == 3 and strategy["init_args"]["pipeline_schedule"] == "gpipe"


@pytest.mark.timeout(600)
def test_quickstart_config_trains_in_3d_on_8_processes(tmp_path: Path) -> None:
    config = str(ROOT / "cli_configs/cpu_quickstart.yaml")
    overrides = [
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.strategy.init_args.zero_stage=2",
    ]
    proc = _cli("fit", "--config", config, *overrides, timeout=540)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    log = proc.stdout + proc.stderr
    assert "tp=2  pp=2  dp=2  zero_stage=2" in log, log[-3000:]
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert saved["trainer"]["strategy"]["init_args"]["zero_stage"] == 2  # the override reached the run's config
