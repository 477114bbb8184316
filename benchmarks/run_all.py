"""Run every benchmark and rewrite docs/benchmarks.md and its pictures: the one command.

    python -m benchmarks.run_all                  # everything, ~20-25 minutes on the 2-core CPU test machine
    python -m benchmarks.run_all --priority -15   # Linux, as root, on a machine shared with other jobs
    python -m benchmarks.run_all --smoke          # tiny models, one short round, into a temporary directory
    python -m benchmarks.run_all --only dp2_zero0,tp2 --skip-bubble   # a subset

Side by side (:mod:`benchmarks.compare`): three ``torchrun`` groups of 2, 4 and 8 CPU processes run the comparisons
of HybridStrategy with Lightning's strategies, the DeepSpeed engine and plain-torch loops; then the pipeline bubble
benchmark (``benchmarks/pipeline_bubble.py``) runs. Results go to ``benchmarks/results/side_by_side.json``; the
"Side by side" section of ``docs/benchmarks.md`` and ``docs/figures/bench_*.png`` are rewritten.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compare, report  # noqa: E402
from benchmarks.page import write_section_between  # noqa: E402
from benchmarks.pipeline_bubble import SECTION_BEGIN as BUBBLE_BEGIN  # noqa: E402
from benchmarks.pipeline_bubble import _machine, _OtherLoad  # noqa: E402

REAL = {"warmup": 1, "measured": 4, "rounds": 3}
SMOKE = {"warmup": 0, "measured": 1, "rounds": 1}

# What profiling found behind each miss (cause and where it lives), shown under "Misses and their causes" when the
# comparison misses its target in the run; the profile lines under it come from the run itself.
_PER_STEP = " Profiled per-step costs:"
CAUSES: dict[str, str] = {
    "dp2_zero0": "Both average the gradients in 25 MB buckets started during the backward pass (HybridStrategy's"
    " `GradientBuckets` in `lightning_hybrid/sharding/buckets.py`, DDP's reducer), so the difference is the work"
    " around them each step. On 2 shared cores gloo's communication thread competes with the backward compute, and"
    " the last bucket (the embeddings, whose gradient comes last) cannot overlap in either." + _PER_STEP,
    "dp2_zero1": "DeepSpeed's engine runs without Lightning's loop and logging (the example's `training_step` logs"
    " its loss with `sync_dist=True`, an all-reduce per step)." + _PER_STEP,
    "dp2_zero2": "DeepSpeed's engine runs without Lightning's loop and logging (the example's `training_step` logs"
    " its loss with `sync_dist=True`, an all-reduce per step)." + _PER_STEP,
    "dp2_zero3": "Both run FSDP2 with the same wrapping (each block, then the network), so the difference is the"
    " work HybridStrategy does around it each step." + _PER_STEP,
    "tp2": "Both use torch's DTensor styles on the same layers (HybridStrategy splits the fused q|k|v with"
    " `_StridedShard`, the reference permutes the weight once: the same local matmuls)." + _PER_STEP,
    "host_overhead": "With negligible compute the step is the Python of Lightning's loop and of the pipeline runner;"
    " the two rows below split it into Lightning's loop alone (`host_overhead_lightning_floor`) and what"
    " HybridStrategy adds to it (`host_overhead_over_floor`)."
    " The runner's step is data (`lightning_hybrid/pipeline/step_data.py`): per micro-batch it adds, on the first"
    " stage, running `training_step` up to the network call to capture the network's inputs; on the last stage, the"
    " rest of `training_step` around the stage's forward, with `self.log` kept by a stand-in (no Lightning call); on"
    " every stage, the input stubs and pass-through blocks of the cut and one timing record per action. Per step:"
    " one tensor broadcast of the loss and logged values, one Lightning `self.log` per logged name (its"
    " `sync_dist` reduces over the data-parallel group: nothing to reduce here), the gradient stash. Outside the"
    " runner: the stages' notes of the transfers they post, for the hang watchdog (`lightning_hybrid/transfers.py`, a"
    " few dictionary operations per action), Lightning's loop hooks and progress tracking, the `optimizer_step`"
    " closure, which the plain loop does not have, and Lightning's broadcast of rank 0's SIGTERM flag before every"
    " batch (a blocking collective, kept: read a batch late, a rank that got SIGTERM alone would leave while its peers"
    " start a batch it never joins)." + _PER_STEP,
    "host_overhead_lightning_floor": "No HybridStrategy code runs in this row: it is Lightning's loop (hooks,"
    " progress tracking, the automatic optimization's closure, one `self.log`, the SIGTERM broadcast"
    " before every batch) around the plain schedule. Whatever it shows is the part of the host-overhead row that no"
    " Lightning strategy can remove." + _PER_STEP,
    "host_overhead_lightning_floor_bare": "An ablation of the floor, no HybridStrategy code: Lightning's loop around"
    " the plain schedule with the module's `self.log` left out and the epoch loop's per-batch SIGTERM broadcast made a"
    " no-op. What it still shows over the plain loop is the rest of Lightning's loop (the data fetcher and"
    " DistributedSampler, hooks, progress tracking, the optimizer closure)." + _PER_STEP,
    "host_overhead_over_floor": "What HybridStrategy adds to Lightning's own loop, per micro-batch: the first"
    " stage's capture of the network's inputs, the last stage's rest of `training_step` (the loss) around the stage's"
    " forward, the cut's stubs and pass-through blocks, one timing record per action, the watchdog's observer of each"
    " point-to-point wait; per step: the broadcast of the loss and logged values from the last stage, the gradient"
    " stash." + _PER_STEP,
    "3d_2x2x2": "The plain script has no Lightning loop, no `self.log` with `sync_dist` and none of the per-step"
    " checks." + _PER_STEP,
}
for _name in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"):
    for _p in (2, 4):
        CAUSES[f"pp{_p}_{_name}"] = (
            "The same schedule class runs the same stage computation; HybridStrategy adds Lightning's loop and"
            " `self.log`, and its pipeline runner's work per micro-batch (capturing the network inputs by running"
            " `training_step` up to the network call on the ranks that need them, timing each action, switching to"
            " the stage's prepared module swaps) and per step (one tensor broadcast of the results, the gradient"
            " stash): see the host-overhead row." + _PER_STEP
        )


def _compiles(comparison: dict[str, Any]) -> bool:
    return any(comparison[side].get("strategy", {}).get("compile", False) for side in ("a", "b"))


def _deepspeed_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, one short round, results into --out-dir")
    parser.add_argument("--out-dir", type=Path, default=None, help="results, figures and the page go here")
    parser.add_argument("--only", default=None, help="comma-separated comparison names (default: all)")
    parser.add_argument("--skip-bubble", action="store_true", help="do not run benchmarks/pipeline_bubble.py")
    parser.add_argument("--skip-deepspeed", action="store_true", help="leave out the DeepSpeed comparisons")
    parser.add_argument("--priority", type=int, default=None, help="autogroup nice of the ranks (Linux, root)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a group is killed")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (nccl, one GPU per rank) when at least 2 GPUs are visible, else CPU (gloo)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak for MFU, if benchmarks/gpu_smoke.py does not list it",
    )
    parser.add_argument(
        "--render-only",
        type=Path,
        default=None,
        help="rewrite the page and figures from a saved side_by_side.json, running nothing",
    )
    args = parser.parse_args(argv)
    if args.render_only is not None:
        results = json.loads(args.render_only.read_text())
        results["records"] = {name: _tuple_keys(r) for name, r in results["records"].items()}
        page = (args.out_dir / "benchmarks.md") if args.out_dir else ROOT / "docs" / "benchmarks.md"
        text = report.section(results, args.out_dir or ROOT / "docs" / "figures", CAUSES)
        write_section_between(page, report.SECTION_BEGIN, report.SECTION_END, text, before=BUBBLE_BEGIN)
        print(f"rewrote {page} from {args.render_only}")
        return 0
    begin = time.perf_counter()
    settings = dict(SMOKE if args.smoke else REAL)
    settings["profiled_steps"] = settings["warmup"] + settings["measured"]
    if args.out_dir is not None:
        out_dir = args.out_dir
    elif args.smoke:
        out_dir = Path(tempfile.mkdtemp(prefix="bench_smoke_"))
    else:
        out_dir = None
    results_dir = out_dir or ROOT / "benchmarks" / "results"
    figures_dir = out_dir or ROOT / "docs" / "figures"
    page = (out_dir / "benchmarks.md") if out_dir else ROOT / "docs" / "benchmarks.md"
    results_dir.mkdir(parents=True, exist_ok=True)

    device = _device(args.device)
    selected = compare.comparisons(device)
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {c["name"] for c in selected}
        if unknown:
            parser.error(f"--only: unknown comparisons {sorted(unknown)}; known: {[c['name'] for c in selected]}")
        selected = [c for c in selected if c["name"] in names]
    if args.smoke:
        # the smoke run checks the 3D code path with tp=2 x pp=2 x dp=1: 4 processes start much faster than 8
        selected = [{**c, "world": 4, "layout": "tp=2 x pp=2 x dp=1 (smoke)"} if c["group"] == "3d" else c
                    for c in selected]  # fmt: skip
    deepspeed = _deepspeed_version()
    if args.skip_deepspeed or deepspeed is None:
        if deepspeed is None:
            print("deepspeed is not installed (pip install -e '.[bench]'): its comparisons are left out", flush=True)
        selected = [c for c in selected if c["b"]["kind"] not in ("deepspeed", "lightning_deepspeed")]
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        too_big = sorted({c["world"] for c in selected if c["world"] > gpus})
        if too_big:
            print(f"{gpus} GPUs visible: the groups of {too_big} processes (one GPU each) are left out", flush=True)
        selected = [c for c in selected if c["world"] <= gpus]

    machine = {**_machine(), "deepspeed": deepspeed, "worker_autogroup_nice": args.priority, "device": device}
    if device == "cuda":
        import torch

        from benchmarks.gpu_smoke import peak_flops

        name = torch.cuda.get_device_name(0)
        machine.update(gpu=name, gpus=torch.cuda.device_count(), peak_flops=peak_flops(name, args.peak_tflops))
    records: dict[str, dict[str, Any]] = {}
    other_load: dict[str, Optional[float]] = {}
    for group in compare.GROUPS:
        # rows that compile run last in their process: compiling leaves caches, threads and ~200k objects behind,
        # which shifted later rows (the host-overhead rows by 4-8%, measured)
        chosen = sorted((c for c in selected if c["group"] == group), key=_compiles)
        if not chosen:
            continue
        timeout = args.timeout or (300.0 if args.smoke else 1200.0)
        with _OtherLoad() as load:
            records.update(compare.launch_group(group, chosen, smoke=args.smoke, timeout=timeout,
                                                priority=args.priority, device=device,
                                                **{k: settings[k] for k in REAL}))  # fmt: skip
        other_load[f"{chosen[0]['world']} processes"] = load.share
    summaries = {c["name"]: compare.summarise(c, records.get(c["name"], {"error": "not run"})) for c in selected}
    command = (
        "python -m benchmarks.run_all"
        + (" --smoke" if args.smoke else "")
        + (" --device cuda" if device == "cuda" else "")
        + (f" --priority {args.priority}" if args.priority is not None else "")
    )
    results = {
        "benchmark": "side_by_side", "smoke": args.smoke, "command": command, "machine": machine,
        "settings": settings, "other_load": other_load,
        "models": compare.models_for(smoke=args.smoke, device=device),
        "comparisons": selected, "summaries": summaries, "records": records,
        "wall_seconds": time.perf_counter() - begin,
    }  # fmt: skip
    text = report.section(results, figures_dir, CAUSES)
    json_safe = {**results, "records": {k: _json_safe(v) for k, v in records.items()}}
    (results_dir / "side_by_side.json").write_text(json.dumps(json_safe, indent=1, default=str) + "\n")
    write_section_between(page, report.SECTION_BEGIN, report.SECTION_END, text, before=BUBBLE_BEGIN)
    for c in selected:
        s = summaries[c["name"]]
        if "error" in s:
            print(f"{c['name']:<28} FAILED")
        else:
            print(f"{c['name']:<28} {s['a_median'] * 1e3:8.1f} ms vs {s['b_median'] * 1e3:8.1f} ms  ratio"
                  f" {s['ratio']:.2f} ({'met' if s['met'] else 'MISSED'} <= {s['target']:.2f})")  # fmt: skip
    print(f"side by side: {results_dir / 'side_by_side.json'}, {page} ({results['wall_seconds']:.0f} s)", flush=True)

    bubble_ok = True
    if not args.skip_bubble:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "pipeline_bubble.py")]
        if args.smoke:
            cmd += ["--smoke", "--out-dir", str(out_dir)]
        if args.priority is not None:
            cmd += ["--priority", str(args.priority)]
        bubble_ok = subprocess.run(cmd, cwd=ROOT).returncode == 0
    failed = [c["name"] for c in selected if "error" in summaries[c["name"]]]
    if failed:
        print(f"failed comparisons: {failed}", file=sys.stderr)
    print(f"all done in {time.perf_counter() - begin:.0f} s")
    return 0 if bubble_ok and not failed else 1


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    except Exception:
        return "cpu"


def _tuple_keys(record: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`_json_safe` for the meter's ``(dimension, collective)`` keys."""
    inputs = []
    for rank_inputs in record.get("theory_inputs") or []:
        comm = rank_inputs.get("communication")
        if comm is not None:
            rank_inputs = {**rank_inputs, "communication": {tuple(k.split("|")): v for k, v in comm.items()}}
        inputs.append(rank_inputs)
    return {**record, "theory_inputs": inputs} if "theory_inputs" in record else record


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else "|".join(map(str, k))): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
