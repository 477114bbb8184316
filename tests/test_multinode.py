"""Beyond one machine, on one host: two ``torchrun`` agents (``--nnodes 2``, rendezvous on localhost) at
tp2 x pp2 x dp2, and a SLURM-shaped job (every rank started at once with the variables ``srun`` sets, which
Lightning's ``SLURMEnvironment`` reads) at tp2 x pp2 over two "nodes". Each runs ``tests/teardown_fit.py`` as a user
script (``Trainer(devices=..., num_nodes=2)``), 3 optimizer steps of a 2-block nanoGPT, and must train exactly as one
device (losses and final parameters within 1e-5) and exit cleanly on every rank (docs/cli.md, "Launching on several
nodes"). Start-up is most of their cost: 8 and 4 interpreters, which cannot share a launch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import relative_error
from tests.harness import run_reference
from tests.test_teardown import BAD

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, TOL = 3, 4, 1e-5
LAYOUT_3D = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(devices: int, strategy: dict[str, Any], result: Path) -> dict[str, Any]:
    return {"name": result.stem, "devices": devices, "n_layer": 2, "strategy": strategy, "batch_size": BATCH,
            "trainer": {"num_nodes": 2, "max_steps": STEPS}, "result": str(result)}  # fmt: skip


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _check(procs: list[subprocess.Popen], outputs: list[tuple[str, str]], result: Path, dp: int) -> dict[str, Any]:
    """Every process exited 0 with nothing a finished run may print; the run equals one device."""
    for i, (proc, (_out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i}: exit {proc.returncode}\n{err[-4000:]}"
        assert not any(m in err for m in BAD), f"process {i}:\n{err[-4000:]}"
    # the stage table printed at start gives each stage's parameters (one device's count, adding up to the model's)
    err = "".join(e for _, e in outputs)
    table = err.split("lightning-hybrid pipeline stages:\n", 1)[1].splitlines()[1:3]
    params = [int(row.split()[-1].replace(",", "")) for row in table]
    assert len(params) == 2 and min(params) > 0, table
    got = torch.load(result, weights_only=False)
    reference = run_reference({"model": "nanogpt", "model_kwargs": {"n_layer": 2, "bias": False},
                               "data_parallel_size": dp, "batch_size": BATCH, "steps": STEPS})  # fmt: skip
    assert len(got["losses"]) == len(reference["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs one device {b}"
    assert got["params"].keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        assert relative_error(got["params"][name], want) <= TOL, name
    assert sum(params) >= sum(p.numel() for p in reference["params"].values())  # tied copies counted on both ends
    return got


@pytest.mark.timeout(900)
def test_two_torchrun_agents_train_3d_exactly_and_exit_cleanly(tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc_per_node 4`` twice on one host (the c10d rendezvous on localhost): 2x2x2 with
    each node holding one pipeline stage, equal to one device; every agent exits 0 (a rank aborting at exit fails
    its agent)."""
    result = tmp_path / "torchrun.pt"
    port = _free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "multinode", str(ROOT / "tests" / "teardown_fit.py"),
             json.dumps(_spec(4, LAYOUT_3D, result))],
            cwd=tmp_path, env=_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for node in range(2)
    ]
    outputs = _wait(agents, timeout=800)
    got = _check(agents, outputs, result, dp=2)
    assert got["environment"] == "TorchElasticEnvironment"
    assert "RESULT" in outputs[0][0], outputs[0][0][-2000:]  # global rank 0 runs on the first agent


@pytest.mark.timeout(900)
def test_slurm_shaped_job_trains_tp2_pp2_exactly(tmp_path: Path) -> None:
    """Four processes started at once as ``srun`` starts a job of 2 nodes x 2 tasks (``SLURM_NTASKS``,
    ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, the node list):
    Lightning picks its SLURM environment, tensor parallel inside each node and the pipeline across them train as one
    device, and every process exits 0."""
    result = tmp_path / "slurm.pt"
    port = _free_port()
    script = [sys.executable, str(ROOT / "tests" / "teardown_fit.py"), json.dumps(_spec(2, LAYOUT_3D, result))]
    ranks = [
        subprocess.Popen(
            script, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**_environ(), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "multinode-test", "SLURM_NTASKS": "4",
                 "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_NODELIST": "127.0.0.1",
                 "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
                 "MASTER_PORT": str(port)},
        )  # fmt: skip
        for rank in range(4)
    ]
    outputs = _wait(ranks, timeout=800)
    got = _check(ranks, outputs, result, dp=1)
    assert got["environment"] == "SLURMEnvironment"
    assert "RESULT" in outputs[0][0], outputs[0][0][-2000:]
