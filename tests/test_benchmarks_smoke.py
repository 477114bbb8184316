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


# One comparison of each kind (Lightning DDP / FSDP2 / hand TP, DeepSpeed when installed, plain pipelining with a
# single-stage and a two-stage schedule, the tiny host-overhead model) in one group of 2 processes, and the 3D one as
# tp=2 x pp=2 in 4 processes; the 4-process pipeline comparisons run the same code as pp=2 with another world size.
# Most of the time is process start-up and Lightning set-up, so it depends on the machine's load far more than on the
# sizes: the limit below only stops a hang (a run took 5 min with the 2 cores shared by ~40 runnable processes).
SIDE_BY_SIDE_TIMEOUT = 600
SMOKE_COMPARISONS = ["dp2_zero0", "dp2_zero2", "dp2_zero3", "tp2", "pp2_1f1b", "pp2_zbv_zero_bubble", "host_overhead",
                     "host_overhead_lightning_floor", "host_overhead_over_floor", "host_overhead_lightning_floor_bare",
                     "3d_2x2x2"]  # fmt: skip


@pytest.mark.timeout(SIDE_BY_SIDE_TIMEOUT + 60)
def test_side_by_side_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.run_all", "--smoke", "--skip-bubble", "--out-dir", str(tmp_path),
           "--timeout", str(SIDE_BY_SIDE_TIMEOUT - 60), "--only", ",".join(SMOKE_COMPARISONS)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SIDE_BY_SIDE_TIMEOUT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    results = json.loads((tmp_path / "side_by_side.json").read_text())
    names = {c["name"] for c in results["comparisons"]}
    # DeepSpeed is in the test extra: without it its comparison would silently drop out
    assert results["machine"]["deepspeed"] is not None, "deepspeed is not installed (pip install -e '.[test]')"
    assert names == set(SMOKE_COMPARISONS)
    for name in names:
        summary = results["summaries"][name]
        assert "error" not in summary, (name, summary)
        assert summary["a_median"] > 0 and summary["b_median"] > 0 and summary["ratio"] > 0, name

    from benchmarks import report
    from benchmarks.run_all import _tuple_keys

    by_name = {c["name"]: c for c in results["comparisons"]}
    records = {name: _tuple_keys(record) for name, record in results["records"].items()}
    # ZeRO-0 all-reduces exactly the gradients once per step (+ a few bytes of logged loss): the count meets the
    # formula, so a meter or formula that drifts fails here
    data = report.communication_rows(by_name["dp2_zero0"], records["dp2_zero0"], results["models"]["dense"])
    assert [r["dimension"] for r in data] == ["data"] and 1.0 <= data[0]["ratio"] < 1.01, data
    # the smoke run's 3D layout is tp=2 x pp=2 x dp=1 (4 processes)
    for name, dims in (("tp2", ["tensor"]), ("pp2_1f1b", ["pipeline"]), ("3d_2x2x2", ["tensor", "pipeline"])):
        rows = report.communication_rows(by_name[name], records[name], results["models"][by_name[name]["model"]])
        assert [r["dimension"] for r in rows] == dims, (name, rows)
        assert all(r["counted"] > 0 and r["minimum"] > 0 for r in rows), (name, rows)
    state = report.model_state_row(by_name["dp2_zero0"], records["dp2_zero0"])
    assert state is not None and abs(state["deviation"]) < 1e-9, state
    bubble = report.bubble_row(by_name["pp2_1f1b"], records["pp2_1f1b"])
    assert bubble is not None and 0.0 <= bubble["measured"] < 1.0, bubble

    page = (tmp_path / "benchmarks.md").read_text()
    assert report.SECTION_BEGIN in page and report.SECTION_END in page and "| dp2_zero0 |" in page
    assert (tmp_path / "bench_step_time.png").stat().st_size > 0
    assert (tmp_path / "bench_communication.png").stat().st_size > 0
    assert str(tmp_path) in proc.stdout  # nothing went into the repository


def test_gpu_side_of_the_benchmarks_without_a_gpu() -> None:
    """What can be checked of the CUDA path here: on GPUs the DeepSpeed references become Lightning's
    DeepSpeedStrategy, ZeRO-3 is also compared with FSDPStrategy, models grow to GPT-2 small width, and the report
    gains tokens/s per GPU, MFU and peak memory."""
    from benchmarks import compare, report

    cpu = {c["name"]: c for c in compare.comparisons("cpu")}
    gpu = {c["name"]: c for c in compare.comparisons("cuda")}
    assert set(gpu) == set(cpu) | {"dp2_zero3_fsdp1"}
    assert gpu["dp2_zero1"]["b"] == {"kind": "lightning_deepspeed", "zero_stage": 1}
    assert gpu["dp2_zero2"]["b"] == {"kind": "lightning_deepspeed", "zero_stage": 2}
    assert gpu["dp2_zero3_fsdp1"]["b"] == {"kind": "lightning_fsdp"} and cpu["dp2_zero1"]["b"]["kind"] == "deepspeed"
    assert compare.models_for(smoke=False, device="cuda")["dense"]["n_embd"] == 768

    models = compare.models_for(smoke=False, device="cuda")
    comparison = gpu["dp2_zero0"]
    step = 0.5  # seconds: 16 sequences of 1024 tokens over 2 GPUs -> 16384 tokens/s per GPU
    results = {
        "machine": {"device": "cuda", "gpu": "NVIDIA H200", "gpus": 2, "peak_flops": 989e12},
        "models": models, "comparisons": [comparison],
        "summaries": {"dp2_zero0": {"a_median": step, "b_median": 2 * step, "a_peak_memory_bytes": 2**31}},
    }  # fmt: skip
    row = next(line for line in report.gpu_lines(results) if line.startswith("| dp2_zero0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "16,384" and cells[4] == "8,192", cells
    parameters = report._parameters(models["dense"])
    from benchmarks.gpu_smoke import flops_per_token

    assert cells[2] == f"{16384 * flops_per_token(models['dense'], parameters) / 989e12 * 100:.1f}%", cells
    assert cells[3] == "2.00 GiB" and cells[6] == "-", cells


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 60)
def test_gpu_smoke_script_runs_on_cpu(tmp_path: Path) -> None:
    """The single-GPU script (`benchmarks/gpu_smoke.py`) in its CPU mode: the four single-device runs (HybridStrategy
    and Lightning, eager and compiled), the planner's prediction and the two-process pipeline on one device go through
    every code path but CUDA's, so the script a lent GPU runs cannot rot."""
    out = tmp_path / "gpu_smoke.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--cpu-check", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(out.read_text())
    one = results["single_gpu"]
    for kind in ("hybrid", "single_device", "hybrid_compile", "single_device_compile"):
        assert one[kind]["tokens_per_second"] > 0 and one[kind]["parameters"] > 0, (kind, one[kind])
    assert one["step_time_ratio"] > 0 and one["step_time_ratio_compile"] > 0
    memory = one["memory_vs_planner"]
    assert memory["layout"].startswith("tp1 x pp1 x dp1 zero0"), memory
    assert memory["predicted_peak_bytes"] > 0, memory
    # no device memory to measure on CPU
    assert memory["measured_peak_bytes"] is None and memory["measured_over_predicted"] is None, memory
    assert results["pipeline_two_processes"]["backend_used"] == "gloo", results["pipeline_two_processes"]


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 60)
def test_offload_benchmark_smoke(tmp_path: Path) -> None:
    """The optimizer rows and the page section of benchmarks/offload.py (its fit rows need a process group: they
    run in the real benchmark; the offload fit itself is tested in tests/test_deepspeed.py)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--smoke", "--skip-fit", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads((tmp_path / "offload.json").read_text())
    names = [r["optimizer"] for r in results["optimizer"]["rows"]]
    assert names == ["torch AdamW (foreach)", "torch AdamW (fused)", "DeepSpeedCPUAdam"]
    assert all(r["median_ms"] > 0 for r in results["optimizer"]["rows"])
    page = (tmp_path / "benchmarks.md").read_text()
    assert "## Optimizer offload" in page and "DeepSpeedCPUAdam" in page


def test_pooling_runs_takes_the_median_of_every_paired_round_with_a_bootstrap_interval(tmp_path: Path, capsys) -> None:
    """``benchmarks.pooled`` (how docs/benchmarks.md compares two trees over many runs): the median of all paired
    rounds' ratios over the runs having the row, each round's ratio a ratio of medians as in a run's own figure, a
    seeded bootstrap interval around it, and each run's own ratio listed."""
    from benchmarks.pooled import main, pool_rows

    def run(ratios: list[float], cpu: float) -> dict:
        rounds = [{"a": {"wall": [r, r, 9.0 * r] if i == 0 else [r], "cpu": [cpu]}, "b": {"wall": [1.0], "cpu": [1.0]}}
                  for i, r in enumerate(ratios)]  # fmt: skip
        ratio = sorted(ratios)[len(ratios) // 2]
        return {"records": {"row": {"rounds": rounds}}, "summaries": {"row": {"ratio": ratio}}}

    runs = [run([1.0, 1.2, 1.1], 1.1), run([0.9, 1.05], 0.95), {"records": {"other": {"rounds": []}}, "summaries": {}}]
    pooled = pool_rows(runs)["row"]
    assert pooled.median == pytest.approx(1.05) and pooled.rounds == 5  # the median of 1.0 1.2 1.1 0.9 1.05
    assert 0.9 <= pooled.low <= pooled.median <= pooled.high <= 1.2 and pooled.low < pooled.high
    assert pooled.cpu_median == pytest.approx(1.1) and pooled.runs == [1.1, 1.05]
    assert pool_rows(runs)["row"] == pooled  # seeded: the same interval every time

    for i, result in enumerate(runs[:2]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "side_by_side.json").write_text(json.dumps(result))
    main(["--label", "before", str(tmp_path / "0"), "--label", "now", str(tmp_path / "0"), str(tmp_path / "1")])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("| row | before: 1 | 3 | 1.100x") for line in lines), lines
    assert any(line.startswith("| row | now: 2 | 5 | 1.050x") for line in lines), lines


def test_the_set_up_peak_table_compares_each_rank_with_its_bound() -> None:
    """`benchmarks/big_model_memory.py --setup` (its heavy runs are not in the suite): each rank of a big model against
    the same rank of a tiny model of its family and depth in the same layout, the bound being the rank's own shards
    plus the largest tensor any rank holds a part of; a rank over it is shown with the excess (in KiB under 1 MiB);
    the family's 2-layer tiny model is a column beside it."""
    from benchmarks.big_model_memory import setup_report, setup_rows

    mib = 2**20

    def rank(r: int, first: int, shards: int = 0, largest: int = 0) -> dict[str, int]:
        return {"rank": r, "stage": r, "first_step": first * mib, "resident_first_step": (first - 10) * mib,
                "shards": shards * mib, "largest": largest * mib, "materialize_peak": largest * mib}  # fmt: skip

    cases = [
        {"model": "llama-tiny", "construction": "deferred", "layout": "pp2", "ranks": [rank(0, 396), rank(1, 398)]},
        {"model": "llama-tiny-24", "construction": "deferred", "layout": "pp2", "ranks": [rank(0, 400), rank(1, 402)]},
        {"model": "llama-0.47b", "construction": "deferred", "layout": "pp2",
         "ranks": [rank(0, 1400, shards=900, largest=100), rank(1, 1403, shards=880, largest=50)]},
        {"model": "llama-tiny", "construction": "deferred", "layout": "tp2-pp2", "ranks": [rank(0, 400)]},
        {"model": "llama-tiny-24", "construction": "deferred", "layout": "tp2-pp2", "ranks": [rank(0, 400)]},
        {"model": "llama-0.47b", "construction": "deferred", "layout": "tp2-pp2",
         "ranks": [{**rank(0, 0, shards=500, largest=100), "first_step": 1000 * mib + 228 * 2**10}]},
    ]  # fmt: skip
    rows = setup_rows(cases)
    found = [(r["above"] // mib, r["bound"] // mib, r["holds"], r["above_shallow"] // mib) for r in rows]
    assert found == [(1000, 1000, True, 1004), (1001, 980, False, 1005), (600, 600, False, 600)]
    assert rows[1]["transient"] == 10 * mib
    report = setup_report(cases)
    assert "| llama-0.47b | pp2 | 1 (1) |" in report and "no (+21 MiB)" in report and "no (+228 KiB)" in report
