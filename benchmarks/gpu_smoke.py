"""The GPU path of the benchmarks, as one short script for a single GPU: tokens/s, MFU and peak memory.

Part 1 (one process, tp=pp=dp=1): a 1.0B-parameter nanoGPT (the example's model, 18 blocks of width 2048, 16 heads,
vocabulary 50304, sequence 1024, tied embedding; bf16-mixed, AdamW) trained four ways, alternated per round
(A B A B): ``hybrid`` (``HybridStrategy(zero_stage=0)``), ``single_device`` (Lightning's default strategy),
``hybrid_compile`` (``HybridStrategy(zero_stage=0, compile=True)``: the strategy compiles each transformer block) and
``single_device_compile`` (Lightning's default strategy, each block compiled by the user before fit with
``block.compile()``, the regional compilation torchtitan does). For each: tokens/s (median and min-max over rounds),
model FLOPs utilisation (MFU) and peak GPU memory; and the step-time ratio HybridStrategy / single device, eager and
compiled. The first steps of every run are dropped (2 eager, 3 compiled, so compiling is not timed).
The eager HybridStrategy run's peak memory (``torch.cuda.max_memory_allocated()``) is set against the planner's
prediction for the same layout (``lightning_hybrid.planning.plan``: tp=pp=dp=1, ZeRO-0, the model built on the meta
device, the same sequence, micro-batch, precision and optimizer, no recompute, the GPU's memory).
Part 2 (two processes on the same GPU, pp=2, 1F1B, the GPT-2-small-width model): NCCL refuses two ranks on one device
on most setups, so the run is tried with ``nccl`` and, if that fails, with ``gloo`` (CPU staging of the stage-to-stage
tensors); which one ran is recorded. It checks that the pipeline path works on CUDA, not its speed.

Usage (from the repository root, on a machine with one CUDA GPU; about 4 minutes on an H200, of which about 1.5 for
part 2 and most of the rest compiling, once cold and then from inductor's cache):
    python benchmarks/gpu_smoke.py                     # writes benchmarks/results/gpu_smoke.json
    python benchmarks/gpu_smoke.py --write-docs        # and the "GPU" section of docs/benchmarks.md
    python benchmarks/gpu_smoke.py --cpu-check         # tiny model on CPU: checks the script itself (no GPU needed)

MFU = achieved model FLOPs / the GPU's peak dense bf16 FLOPs, with 6·N FLOPs per token for the parameters and
12·layers·sequence·width for attention (PaLM, Chowdhery et al. 2022, appendix B). Peak values for common GPUs are in
``PEAK_BF16_TFLOPS``; pass ``--peak-tflops`` for others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "V100": 125.0}  # fmt: skip
# 18 x (12·2048² + 13·2048) + (50304 + 1024)·2048 + 2·2048 = 1,011,572,736 parameters. The head is tied to the token
# embedding (as in GPT-2 and nanoGPT): 6·N then counts the vocabulary matrix once, as the head's product it is.
GPU_MODEL = {"vocab_size": 50304, "block_size": 1024, "n_layer": 18, "n_head": 16, "n_embd": 2048, "tie_weights": True}
CPU_CHECK_MODEL = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "tie_weights": True}
# part 2 keeps the models and batch it had before part 1 grew: it checks the pipeline path, not speed
PIPELINE_MODEL = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
CPU_CHECK_PIPELINE_MODEL = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}
PIPELINE_BATCH = 8
KINDS = ("hybrid", "single_device", "hybrid_compile", "single_device_compile")
LABELS = {"hybrid": "HybridStrategy (tp=pp=dp=1)", "single_device": "Lightning single device",
          "hybrid_compile": "HybridStrategy, `compile=True`",
          "single_device_compile": "Lightning single device, `block.compile()` per block"}  # fmt: skip
SECTION_BEGIN = "<!-- gpu_smoke: begin (written by benchmarks/gpu_smoke.py) -->"
SECTION_END = "<!-- gpu_smoke: end -->"


def flops_per_token(model: dict[str, Any], parameters: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus 12·L·T·E for attention scores and values."""
    return 6 * parameters + 12 * model["n_layer"] * model["block_size"] * model["n_embd"]


def peak_flops(device_name: str, override_tflops: Optional[float]) -> Optional[float]:
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def warmup_steps(kind: str) -> int:
    """Steps dropped before timing: compiling happens in the first step's forward and backward; one more step than
    eager so no recompile (or inductor's lazy autotuning) lands in the timed ones."""
    return 3 if kind.endswith("_compile") else 2


def _release(device: str) -> None:
    """Free what earlier runs left (Lightning's trainer and module reference each other: only the cycle collector
    frees them), so one run's model and optimizer state never count in the next run's peak."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _train(kind: str, model: dict[str, Any], batch: int, steps: int, device: str, precision: str) -> dict[str, Any]:
    """One run in this process: per-step seconds (synchronized), tokens/s and peak memory."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.plain_torch import token_batches
    from examples.nanogpt import NanoGPT

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            if device == "cuda":
                torch.cuda.synchronize()  # kernels are asynchronous: a step ends when the GPU is done
            self.ends.append(time.perf_counter())

    compiled = kind.endswith("_compile")
    _release(device)
    if compiled:
        # every compiled run compiles its blocks afresh (from inductor's on-disk cache after the first), so runs do
        # not depend on each other and dynamo's per-function recompile limit is never reached across runs
        torch.compiler.reset()
    baseline = torch.cuda.memory_allocated() if device == "cuda" else None
    L.seed_everything(1234, verbose=False)
    tokens = token_batches(model["vocab_size"], model["block_size"], batch, steps)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    with torch.device(device):  # initialised where it trains: 2e9 random draws on the GPU, not seconds of CPU per run
        module = NanoGPT(**model)
    parameters = sum(p.numel() for p in module.parameters())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = Clock()
    strategy: Any = "auto"
    if kind.startswith("hybrid"):
        from lightning_hybrid import HybridStrategy

        strategy = HybridStrategy(zero_stage=0, compile=compiled)
    elif compiled:
        for block in module.model.h:  # what a user does without the strategy: regional compilation, as torchtitan
            block.compile()
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy,
                        precision=precision, max_steps=steps, callbacks=[clock], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    begin = time.perf_counter()
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch, drop_last=True))
    warmup = warmup_steps(kind)
    times = [b - a for a, b in zip(clock.ends[warmup - 1 :], clock.ends[warmup:])]
    step = statistics.median(times)
    return {
        "kind": kind,
        "step_seconds": step,
        "warmup_seconds": clock.ends[warmup - 1] - begin,  # set-up and the dropped steps: compile time shows here
        "tokens_per_second": batch * model["block_size"] / step,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "baseline_memory_bytes": baseline,
        "parameters": parameters,
    }


def planner_prediction(model: dict[str, Any], batch: int, precision: str, device: str) -> dict[str, Any]:
    """The planner's ledger for exactly part 1's eager HybridStrategy run: one device, ZeRO-0, no recompute."""
    import torch

    from examples.nanogpt import NanoGPT
    from lightning_hybrid.planning import GB, plan

    with torch.device("meta"):  # shapes only: the planner reads the sizes and counts the parameters
        module = NanoGPT(**model)
    memory = torch.cuda.get_device_properties(0).total_memory / GB if device == "cuda" else None
    result = plan(module, seq=model["block_size"], micro_batch=batch, precision=precision, optimizer="adamw",
                  recompute="none", device_memory=memory, gpu="H200", nodes=1, devices_per_node=1,
                  tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, zero_stage=0)  # fmt: skip
    (layout,) = result.layouts  # every size is fixed: one layout
    return {
        "layout": layout.candidate.describe(),
        "predicted_peak_bytes": layout.ledger.peak,
        "ledger": layout.ledger.as_dict(),
        "feasible": layout.feasible,
        "verdict": layout.reason,
    }


def part_one(args: argparse.Namespace, model: dict[str, Any], device: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            runs[kind].append(_train(kind, model, args.batch_size, args.steps, device, args.precision))
    _release(device)  # part 2's processes share the GPU
    out: dict[str, Any] = {}
    name = _device_name(device)
    peak = peak_flops(name, args.peak_tflops)
    for kind, rows in runs.items():
        tps = [r["tokens_per_second"] for r in rows]
        median = statistics.median(tps)
        out[kind] = {
            "tokens_per_second": median, "min": min(tps), "max": max(tps),
            "step_seconds": statistics.median(r["step_seconds"] for r in rows),
            "warmup_seconds": [r["warmup_seconds"] for r in rows],
            "mfu": median * flops_per_token(model, rows[0]["parameters"]) / peak if peak else None,
            "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in rows) or None,
            "baseline_memory_bytes": max((r["baseline_memory_bytes"] or 0) for r in rows),
            "parameters": rows[0]["parameters"],
        }  # fmt: skip

    def ratio(a: str, b: str) -> float:  # per round, then the median: drift between rounds cancels
        return statistics.median(x["step_seconds"] / y["step_seconds"] for x, y in zip(runs[a], runs[b]))

    out["step_time_ratio"] = ratio("hybrid", "single_device")
    out["step_time_ratio_compile"] = ratio("hybrid_compile", "single_device_compile")
    memory = planner_prediction(model, args.batch_size, args.precision, device)
    measured = out["hybrid"]["peak_memory_bytes"]
    memory["measured_peak_bytes"] = measured
    memory["measured_over_predicted"] = measured / memory["predicted_peak_bytes"] if measured else None
    out["memory_vs_planner"] = memory
    out["device"], out["peak_flops"] = name, peak
    return out


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _pipeline_worker(config: dict[str, Any]) -> None:
    """Rank of part 2: pp=2 on one device, 1F1B, a few steps."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.plain_torch import token_batches
    from examples.nanogpt import NanoGPT
    from lightning_hybrid import HybridStrategy

    model, batch, steps, device = config["model"], config["batch_size"], config["steps"], config["device"]
    # Two ranks on one device: Lightning maps local rank r to device r, and there is only device 0. Each rank is
    # presented to Lightning as the only process of its own "node" (num_nodes=2, devices=1), so both use device 0.
    os.environ["GROUP_RANK"] = os.environ["RANK"]
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    if device == "cuda":
        torch.cuda.set_device(0)
    L.seed_everything(1234, verbose=False)
    tokens = token_batches(model["vocab_size"], model["block_size"], batch, steps)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    strategy = HybridStrategy(pipeline_parallel_size=2, num_microbatches=4, zero_stage=0,
                              process_group_backend=config["backend"])  # fmt: skip
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, num_nodes=2, strategy=strategy,
                        precision=config["precision"], max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)  # fmt: skip
    begin = time.perf_counter()
    trainer.fit(NanoGPT(**model), train_dataloaders=DataLoader(data, batch_size=batch, drop_last=True))
    if trainer.global_rank == 0:
        Path(config["out"]).write_text(json.dumps({"seconds": time.perf_counter() - begin, "steps": steps}))


def part_two(args: argparse.Namespace, model: dict[str, Any], device: str) -> dict[str, Any]:
    import tempfile

    tried: dict[str, Any] = {}
    for backend in ("nccl", "gloo") if device == "cuda" else ("gloo",):
        with tempfile.TemporaryDirectory() as work:
            config = {"model": model, "batch_size": PIPELINE_BATCH, "steps": 3, "device": device,
                      "backend": backend, "precision": args.precision, "out": str(Path(work) / "out.json")}  # fmt: skip
            path = Path(work) / "config.json"
            path.write_text(json.dumps(config))
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(Path(__file__).resolve()), "--pipeline-worker", str(path)]  # fmt: skip
            try:
                proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
                ok = proc.returncode == 0 and Path(config["out"]).exists()
                tried[backend] = json.loads(Path(config["out"]).read_text()) if ok else {"error": proc.stderr[-1500:]}
            except subprocess.TimeoutExpired:
                ok, tried[backend] = False, {"error": f"timeout after {args.timeout} s"}
        if ok:
            tried["backend_used"] = backend
            break
    return tried


def _gib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def _section(results: dict[str, Any]) -> str:
    one, two = results["single_gpu"], results["pipeline_two_processes"]
    memory = one["memory_vs_planner"]

    def row(kind: str) -> str:
        r = one[kind]
        mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%"
        return (f"| {LABELS[kind]} | {r['tokens_per_second']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | {mfu} |"
                f" {_gib(r['peak_memory_bytes'])} |")  # fmt: skip

    ratio = memory["measured_over_predicted"]
    m = results["model"]
    return "\n".join([
        SECTION_BEGIN, "## GPU (single device)", "",
        f"`{results['command']}` on {one['device']}; torch {results['torch']}, precision {results['precision']},"
        f" AdamW; model of {one['hybrid']['parameters']:,} parameters, {m['n_layer']} blocks of width {m['n_embd']},"
        f" {m['n_head']} heads, vocabulary {m['vocab_size']}, sequence {m['block_size']}, batch"
        f" {results['batch_size']}; {results['rounds']} round(s) of {results['steps']} steps per strategy, alternated,"
        f" the first {warmup_steps('hybrid')} (compiled: {warmup_steps('hybrid_compile')}) steps of each run not"
        " timed.", "",
        "| strategy | tokens/s (min-max) | MFU | peak memory |", "| --- | --- | --- | --- |",
        *(row(kind) for kind in KINDS), "",
        f"Step time ratio HybridStrategy / single device: {one['step_time_ratio']:.3f} eager,"
        f" {one['step_time_ratio_compile']:.3f} with each block compiled.", "",
        f"The eager HybridStrategy run's `torch.cuda.max_memory_allocated()` (max over rounds) against the planner's"
        f" peak per device (`lightning_hybrid.planning.plan`, {memory['layout']}, {results['precision']}, AdamW,"
        " the model on the meta device); the ratio is measured / predicted:", "",
        f"peak memory: measured {_gib(memory['measured_peak_bytes'])}, planner predicted"
        f" {_gib(memory['predicted_peak_bytes'])} ({'-' if ratio is None else f'{ratio:.2f}x'})", "",
        f"Pipeline of 2 processes on the one GPU: {two.get('backend_used', 'failed')}.", "", SECTION_END,
    ]) + "\n"  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-check", action="store_true", help="tiny model on CPU: checks the script, no GPU")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on GPU, 32-true with --cpu-check")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not listed")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_smoke.json")
    parser.add_argument("--write-docs", action="store_true", help="write the GPU section of docs/benchmarks.md")
    parser.add_argument("--pipeline-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pipeline_worker is not None:
        _pipeline_worker(json.loads(args.pipeline_worker.read_text()))
        return 0
    import torch

    if args.steps < warmup_steps("hybrid_compile") + 1:
        parser.error(f"--steps must leave a timed step after the {warmup_steps('hybrid_compile')} dropped ones")
    if args.cpu_check:
        device, model, pipeline_model = "cpu", CPU_CHECK_MODEL, CPU_CHECK_PIPELINE_MODEL
        args.steps, args.rounds = min(args.steps, 4), 1
    elif torch.cuda.is_available():
        device, model, pipeline_model = "cuda", GPU_MODEL, PIPELINE_MODEL
    else:
        print("no CUDA device: run with --cpu-check to check the script on CPU", file=sys.stderr)
        return 2
    args.precision = args.precision or ("bf16-mixed" if device == "cuda" else "32-true")
    begin = time.perf_counter()
    results: dict[str, Any] = {
        "command": "python benchmarks/gpu_smoke.py" + (" --cpu-check" if args.cpu_check else ""),
        "torch": torch.__version__, "precision": args.precision, "model": model, "batch_size": args.batch_size,
        "steps": args.steps, "rounds": args.rounds, "pipeline_model": pipeline_model,
        "pipeline_batch_size": PIPELINE_BATCH, "single_gpu": part_one(args, model, device),
    }  # fmt: skip
    results["part_one_seconds"] = time.perf_counter() - begin
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")  # part 1 kept should part 2 hang past a device limit
    results["pipeline_two_processes"] = part_two(args, pipeline_model, device)
    results["wall_seconds"] = time.perf_counter() - begin
    section = _section(results)  # built every time, --cpu-check included, so its formatting cannot rot either
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    one = results["single_gpu"]
    for kind in KINDS:
        r = one[kind]
        mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%"
        print(f"{kind:<22} {r['tokens_per_second']:12,.0f} tokens/s  MFU {mfu:>6}  peak {_gib(r['peak_memory_bytes'])}"
              f"  warm-up {max(r['warmup_seconds']):.0f} s")  # fmt: skip
    memory = one["memory_vs_planner"]
    print(f"step time ratio hybrid / single device: eager {one['step_time_ratio']:.3f},"
          f" compiled {one['step_time_ratio_compile']:.3f}")  # fmt: skip
    print(f"peak memory: measured {_gib(memory['measured_peak_bytes'])}, planner predicted"
          f" {_gib(memory['predicted_peak_bytes'])} ({memory['layout']})")  # fmt: skip
    print(f"pipeline of 2 on one device: {results['pipeline_two_processes'].get('backend_used', 'FAILED')}")
    if args.write_docs:
        from benchmarks.page import write_section_between

        write_section_between(ROOT / "docs" / "benchmarks.md", SECTION_BEGIN, SECTION_END, section)
    print(f"results: {args.out} ({results['wall_seconds']:.0f} s, part 1 {results['part_one_seconds']:.0f} s)")
    return 0 if "backend_used" in results["pipeline_two_processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
