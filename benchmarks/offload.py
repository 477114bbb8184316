"""Optimizer offload, side by side in one run: ``HybridStrategy(offload_optimizer=True)`` against the same layout
without it, DeepSpeed's ``DeepSpeedCPUAdam`` against torch's AdamW (``foreach`` and ``fused``) on CPU, and the
model-state bytes each rank keeps on the device.

    python benchmarks/offload.py              # optimizer: 67M parameters; fit: 2 CPU processes, dp=2 ZeRO-1, nanoGPT
    python benchmarks/offload.py --smoke --out-dir /tmp/x   # tiny sizes, one round (the test suite runs this)

The optimizer rows step one flat fp32 tensor (with a gradient) in this process, rounds alternating the three
optimizers, and report the median ms per step. The fit rows run in one ``torchrun`` group: fresh fits without and
with offload alternate (A B A B), each timing its steps after a warm-up; the model-state report is the strategy's
``model_state_bytes`` on rank 0. Results go to ``benchmarks/results/offload.json`` and the "Optimizer offload"
section of ``docs/benchmarks.md`` (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.page import write_section_between  # noqa: E402

SECTION_BEGIN = "<!-- offload: begin (written by benchmarks/offload.py) -->"
SECTION_END = "<!-- offload: end -->"


def _optimizers(params: list[torch.Tensor], cpu_adam: bool = True) -> dict[str, Any]:
    from lightning_hybrid.sharding.offload import cpu_adam_class

    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    out: dict[str, Any] = {
        "torch AdamW (foreach)": torch.optim.AdamW(params, foreach=True, **kwargs),
        "torch AdamW (fused)": torch.optim.AdamW(params, fused=True, **kwargs),
    }
    if cpu_adam:
        out["DeepSpeedCPUAdam"] = cpu_adam_class()(params, adamw_mode=True, **kwargs)
    return out


def optimizer_rows(numel: int, rounds: int, steps: int) -> dict[str, Any]:
    """Median ms per step of each optimizer on ``numel`` fp32 parameters (one tensor each, same gradient)."""
    torch.manual_seed(0)
    times: dict[str, list[float]] = {}
    tensors = {}
    for name in ("torch AdamW (foreach)", "torch AdamW (fused)", "DeepSpeedCPUAdam"):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel) * 1e-3
        tensors[name] = p
    cpu_adam = _optimizers([tensors["DeepSpeedCPUAdam"]])["DeepSpeedCPUAdam"]
    optimizers = {name: _optimizers([tensors[name]], cpu_adam=False)[name] for name in list(tensors)[:2]}
    optimizers["DeepSpeedCPUAdam"] = cpu_adam
    for optimizer in optimizers.values():
        optimizer.step()  # state made outside the timing
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            begin = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            times.setdefault(name, []).append((time.perf_counter() - begin) / steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["torch AdamW (foreach)"]
    return {
        "numel": numel,
        "threads": torch.get_num_threads(),
        "rows": [
            {
                "optimizer": n,
                "median_ms": m * 1e3,
                "min_ms": min(times[n]) * 1e3,
                "max_ms": max(times[n]) * 1e3,
                "ratio_to_foreach": m / base,
            }
            for n, m in medians.items()
        ],  # fmt: skip
    }


class _StepTimer:
    def __init__(self) -> None:
        import lightning as L

        class Timer(L.Callback):
            def __init__(self) -> None:
                self.seconds: list[float] = []
                self.start = 0.0

            def on_train_batch_start(self, *args: Any) -> None:
                self.start = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                self.seconds.append(time.perf_counter() - self.start)

        self.callback = Timer()


def _fit(args: argparse.Namespace, offload: bool) -> dict[str, Any]:
    import lightning as L

    from examples.nanogpt import NanoGPT
    from lightning_hybrid import HybridStrategy
    from tests.harness import make_dataset

    L.seed_everything(1234, verbose=False)
    module = NanoGPT(vocab_size=128, block_size=16, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, bias=False)
    module.example_input_array = None
    timer = _StepTimer().callback
    strategy = HybridStrategy(zero_stage=args.zero_stage, offload_optimizer=offload, monitor=False,
                              health_checks=False)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.warmup + args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(module, train_dataloaders=loader)
    measured = timer.seconds[args.warmup :]
    return {
        "offload": offload,
        "median_step_s": statistics.median(measured),
        "step_s": measured,
        "model_state_bytes": dict(trainer.strategy.model_state_bytes),
        "parameters": sum(p.numel() for p in module.parameters()),
        "rank": trainer.global_rank,
    }


def fit_rows(args: argparse.Namespace) -> None:
    """Inside the torchrun group: fits alternating without and with offload; rank 0 writes the records."""
    torch.set_num_threads(1)
    records = [_fit(args, offload) for _ in range(args.rounds) for offload in (False, True)]
    if records[0]["rank"] == 0:
        Path(args.fit_output).write_text(json.dumps(records))


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def section(results: dict[str, Any]) -> str:
    opt, fits = results["optimizer"], results["fit"]
    lines = [SECTION_BEGIN, "## Optimizer offload", ""]
    lines.append(
        f"Measured with `{results['command']}` ({results['date']}, {results['machine']}). "
        + results["load_note"]
        + " Compare the ratios, which are measured within this one run, more than the absolute times."
    )
    lines += ["", f"**Optimizer step on CPU**, {opt['numel'] / 1e6:.1f}M fp32 parameters, {opt['threads']} thread(s),"
              f" median of {results['settings']['rounds']} rounds:", "",
              "| optimizer | ms per step (median) | min-max | vs AdamW foreach |",
              "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for r in opt["rows"]:
        lines.append(
            f"| {r['optimizer']} | {r['median_ms']:.1f} | {r['min_ms']:.1f}-{r['max_ms']:.1f} |"
            f" {r['ratio_to_foreach']:.2f} |"
        )
    if not fits:
        lines += ["", "(The fit rows were not run: `--skip-fit`.)", SECTION_END]
        return "\n".join(lines) + "\n"
    offloaded = [f for f in fits if f["offload"]]
    plain = [f for f in fits if not f["offload"]]
    plain_ms = statistics.median([f["median_step_s"] for f in plain]) * 1e3
    offload_ms = statistics.median([f["median_step_s"] for f in offloaded]) * 1e3
    layout = results["layout"]
    lines += ["", f"**Training step**, {layout} ({fits[0]['parameters'] / 1e6:.2f}M parameters), fits alternating"
              " without and with offload in one process group, median step time after the warm-up:", "",
              "| run | ms per step | ratio |", "| --- | ---: | ---: |",
              f"| without offload | {plain_ms:.1f} | 1.00 |",
              f"| `offload_optimizer=True` | {offload_ms:.1f} | {offload_ms / plain_ms:.2f} |", ""]  # fmt: skip
    a, b = plain[-1]["model_state_bytes"], offloaded[-1]["model_state_bytes"]
    lines += ["**Model-state bytes on the device** (rank 0, `strategy.model_state_bytes`):", "",
              "| | parameters | gradients | optimizer state | total on the device | in host memory instead |",
              "| --- | ---: | ---: | ---: | ---: | ---: |",
              f"| without offload | {_mib(a['parameters'])} | {_mib(a['gradients'])} | {_mib(a['optimizer_state'])} |"
              f" {_mib(a['total'])} | - |",
              f"| `offload_optimizer=True` | {_mib(b['parameters'])} | {_mib(b['gradients'])} |"
              f" {_mib(b['optimizer_state'])} | {_mib(b['total'])} | {_mib(b.get('offloaded_optimizer_state', 0))} |",
              "",
              "On a CPU-only machine the device *is* host memory: the offloaded state is where it would be anyway and"
              " nothing is copied, so the step-time row measures DeepSpeedCPUAdam replacing torch's AdamW inside the"
              " step. On a GPU the same ledger is the memory the GPU no longer holds, and the step then also pays the"
              " gradient copy to host memory (overlapped with backward at ZeRO-2) and the parameter copy back.",
              SECTION_END]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_section(page: Path, text: str) -> None:
    write_section_between(page, SECTION_BEGIN, SECTION_END, text)


def _launch_fits(args: argparse.Namespace, argv: list[str] | None) -> list[dict[str, Any]] | None:
    """The fit rows, in one torchrun group of ``--devices`` processes; None if the group failed."""
    with tempfile.TemporaryDirectory() as tmp:
        fit_output = Path(tmp) / "fit.json"
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--smoke"]
        sizes = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--batch-size", str(args.batch_size),
                 "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds)]  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.devices),
               __file__, *forwarded, *sizes, "--fit-output", str(fit_output)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout)
        if proc.returncode != 0:
            print(f"the fit group failed with exit code {proc.returncode}", file=sys.stderr)
            return None
        return json.loads(fit_output.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round, into --out-dir")
    parser.add_argument("--out-dir", type=Path, default=None, help="results and the page go here")
    parser.add_argument("--numel", type=int, default=67_000_000, help="parameters of the optimizer rows")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--skip-fit", action="store_true", help="only the optimizer rows (no process group)")
    parser.add_argument("--fit-output", default=None, help=argparse.SUPPRESS)  # the worker's output file
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        fit_rows(args)
        return 0
    if args.smoke:
        args.numel, args.n_layer, args.n_embd, args.batch_size = 100_000, 2, 32, 4
        args.warmup, args.steps, args.rounds = 1, 2, 1
    begin = time.perf_counter()
    torch.set_num_threads(1)
    optimizer = optimizer_rows(args.numel, args.rounds, 1 if args.smoke else 5)
    fits: list[dict[str, Any]] = [] if args.skip_fit else _launch_fits(args, argv)
    if fits is None:
        return 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = {
        "benchmark": "offload",
        "smoke": args.smoke,
        "command": "python benchmarks/offload.py" + (" --smoke" if args.smoke else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "load_note": (
            f"The machine was shared with other jobs (1-minute load average {load:.0f} at the end of the run), so"
            " absolute times are inflated and noisy."
            if load is not None and load > (os.cpu_count() or 1)
            else "The machine was otherwise idle."
        ),
        "layout": f"{args.devices} CPU processes, dp={args.devices}, ZeRO-{args.zero_stage}",
        "settings": {"rounds": args.rounds, "warmup": args.warmup, "steps": args.steps},
        "optimizer": optimizer,
        "fit": fits,
        "wall_seconds": time.perf_counter() - begin,
    }
    results_dir = args.out_dir or ROOT / "benchmarks" / "results"
    page = (args.out_dir / "benchmarks.md") if args.out_dir else ROOT / "docs" / "benchmarks.md"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "offload.json").write_text(json.dumps(results, indent=1) + "\n")
    write_section(page, section(results))
    for r in optimizer["rows"]:
        print(f"{r['optimizer']:<24} {r['median_ms']:8.1f} ms/step  x{r['ratio_to_foreach']:.2f} of foreach")
    print(f"wrote {results_dir / 'offload.json'} and {page} ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
