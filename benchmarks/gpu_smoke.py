"""The GPU path of the benchmarks, as one short script for a single GPU: tokens/s, MFU and peak memory.

Part 1 (one process, tp=pp=dp=1): the nanoGPT example at GPT-2 small width trained with ``HybridStrategy`` and with
Lightning's default single-device strategy, alternating A B A B; tokens/s per GPU, model FLOPs utilisation (MFU) and
peak GPU memory for both, and the ratio.
Part 2 (two processes on the same GPU, pp=2, 1F1B): NCCL refuses two ranks on one device on most setups, so the run
is tried with ``nccl`` and, if that fails, with ``gloo`` (CPU staging of the stage-to-stage tensors); which one ran
is recorded. It checks that the pipeline path works on CUDA, not its speed.

Usage (from the repository root, on a machine with one CUDA GPU; about 3-4 minutes):
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
GPU_MODEL = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
CPU_CHECK_MODEL = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}
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

    L.seed_everything(1234, verbose=False)
    tokens = token_batches(model["vocab_size"], model["block_size"], batch, steps)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    module = NanoGPT(**model)
    parameters = sum(p.numel() for p in module.parameters())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = Clock()
    strategy: Any = "auto"
    if kind == "hybrid":
        from lightning_hybrid import HybridStrategy

        strategy = HybridStrategy(zero_stage=0)
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy,
                        precision=precision, max_steps=steps, callbacks=[clock], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch, drop_last=True))
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])][1:]  # the first two steps warm up
    step = statistics.median(times)
    return {
        "kind": kind,
        "step_seconds": step,
        "tokens_per_second": batch * model["block_size"] / step,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "parameters": parameters,
    }


def part_one(args: argparse.Namespace, model: dict[str, Any], device: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"hybrid": [], "single_device": []}
    for _ in range(args.rounds):
        for kind in ("hybrid", "single_device"):
            runs[kind].append(_train(kind, model, args.batch_size, args.steps, device, args.precision))
    out: dict[str, Any] = {}
    name = _device_name(device)
    peak = peak_flops(name, args.peak_tflops)
    for kind, rows in runs.items():
        tps = [r["tokens_per_second"] for r in rows]
        median = statistics.median(tps)
        out[kind] = {
            "tokens_per_second": median, "min": min(tps), "max": max(tps),
            "mfu": median * flops_per_token(model, rows[0]["parameters"]) / peak if peak else None,
            "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in rows) or None,
            "parameters": rows[0]["parameters"],
        }  # fmt: skip
    ratios = [h["step_seconds"] / s["step_seconds"] for h, s in zip(runs["hybrid"], runs["single_device"])]
    out["step_time_ratio"] = statistics.median(ratios)
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
            config = {"model": model, "batch_size": args.batch_size, "steps": 3, "device": device,
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


def _section(results: dict[str, Any]) -> str:
    one, two = results["single_gpu"], results["pipeline_two_processes"]

    def row(kind: str, label: str) -> str:
        r = one[kind]
        mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%"
        memory = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f} GiB"
        return f"| {label} | {r['tokens_per_second']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | {mfu} | {memory} |"

    return "\n".join([
        SECTION_BEGIN, "## GPU (single device)", "",
        f"`{results['command']}` on {one['device']}; torch {results['torch']}, precision {results['precision']},"
        f" model {results['model']['n_layer']} blocks of width {results['model']['n_embd']}, sequence"
        f" {results['model']['block_size']}, batch {results['batch_size']}.", "",
        "| strategy | tokens/s (min-max) | MFU | peak memory |", "| --- | --- | --- | --- |",
        row("hybrid", "HybridStrategy (tp=pp=dp=1)"), row("single_device", "Lightning single device"), "",
        f"Step time ratio HybridStrategy / single device: {one['step_time_ratio']:.3f}. Pipeline of 2 processes on"
        f" the one GPU: {two.get('backend_used', 'failed')}.", "", SECTION_END,
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

    if args.cpu_check:
        device, model = "cpu", CPU_CHECK_MODEL
        args.steps, args.rounds = min(args.steps, 4), 1
    elif torch.cuda.is_available():
        device, model = "cuda", GPU_MODEL
    else:
        print("no CUDA device: run with --cpu-check to check the script on CPU", file=sys.stderr)
        return 2
    args.precision = args.precision or ("bf16-mixed" if device == "cuda" else "32-true")
    begin = time.perf_counter()
    results = {
        "command": "python benchmarks/gpu_smoke.py" + (" --cpu-check" if args.cpu_check else ""),
        "torch": torch.__version__, "precision": args.precision, "model": model, "batch_size": args.batch_size,
        "single_gpu": part_one(args, model, device),
        "pipeline_two_processes": part_two(args, model, device),
    }  # fmt: skip
    results["wall_seconds"] = time.perf_counter() - begin
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    one = results["single_gpu"]
    for kind in ("hybrid", "single_device"):
        r = one[kind]
        print(f"{kind:<14} {r['tokens_per_second']:12,.0f} tokens/s  MFU {r['mfu']}  peak {r['peak_memory_bytes']}")
    print(f"pipeline of 2 on one device: {results['pipeline_two_processes'].get('backend_used', 'FAILED')}")
    if args.write_docs:
        from benchmarks.run_all import write_section_between

        write_section_between(ROOT / "docs" / "benchmarks.md", SECTION_BEGIN, SECTION_END, _section(results))
    print(f"results: {args.out} ({results['wall_seconds']:.0f} s)")
    return 0 if "backend_used" in results["pipeline_two_processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
