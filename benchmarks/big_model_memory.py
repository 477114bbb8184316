"""Peak memory per rank at set-up: a model built whole on every rank against the same model built in
``configure_model`` (deferred: on the meta device, then only this rank's shards), and a model bigger than this
machine's memory would allow if every rank built it whole.

    python -m benchmarks.big_model_memory          # the 0.55B GPT at tp2 x pp2 (4 processes): tiny, full, deferred
    python -m benchmarks.big_model_memory --big    # also a 0.82B GPT at tp2 x dp4, ZeRO-3 (8 processes), 3 steps
    python -m benchmarks.big_model_memory --smoke  # tiny sizes, nothing written (a quick check of the script)

Each case is one Lightning run on CPU processes (gloo); each rank records its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) when its first training batch starts and after its last step, and the
planner's per-rank prediction for the same model and layout. Results go to ``benchmarks/results/big_models.json`` and
the "Models bigger than one device" section of ``docs/benchmarks.md`` (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTION_BEGIN = "<!-- big models: begin (written by benchmarks/big_model_memory.py) -->"
SECTION_END = "<!-- big models: end -->"
SEQ = 16

# GPT-style, untied head: 12 * layers * hidden^2 (blocks) + 2 * vocab * hidden (embedding and head)
MODELS = {
    "tiny": {"vocab_size": 128, "n_layer": 2, "n_head": 4, "n_embd": 32},
    "gpt-0.55b": {"vocab_size": 32000, "n_layer": 24, "n_head": 16, "n_embd": 1280},
    "gpt-0.82b": {"vocab_size": 8192, "n_layer": 28, "n_head": 16, "n_embd": 1536},
    "smoke": {"vocab_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 64},
    "gpt-0.12b": {"vocab_size": 8192, "n_layer": 8, "n_head": 16, "n_embd": 1024},
}
LAYOUTS = {
    "tp2-pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1, "num_microbatches": 2},
    # 8 processes. (2x2x2 with ZeRO-3 keeps each stage's parameters gathered over data, plus under "per_step" an
    # unsharded copy of its gradients, for the whole step: about 3.6 GB a rank for this model, more than this
    # machine's 24 GB holds for 8 ranks)
    "tp2-dp4-zero3": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "zero_stage": 3, "num_microbatches": 1},
}  # fmt: skip


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _module(model: str, construction: str) -> Any:
    import lightning as L
    import torch

    from examples.nanogpt import GPT, GPTConfig, NanoGPT

    sizes = {**MODELS[model], "block_size": SEQ, "bias": False}
    config = GPTConfig(sizes["vocab_size"], SEQ, sizes["n_layer"], sizes["n_head"], sizes["n_embd"], 0.0, False)

    class Measured(NanoGPT):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)  # not NanoGPT's: where the network is built is the variable here
            self.save_hyperparameters({"learning_rate": 1e-4, "weight_decay": 0.1})
            self.model = GPT(config) if construction == "full" else None
            self.example_input_array = None
            self.peaks: dict[str, int] = {}

        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(config)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.peaks["first_step"] = peak_rss_bytes()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.peaks.setdefault("before_first_optimizer_step", peak_rss_bytes())

        def validation_step(self, *args: Any) -> None:
            return None

    del torch
    return Measured()


def _rank_main(model: str, construction: str, layout: str, steps: int, out: Path) -> None:
    """One rank (Lightning's launcher runs this script once per process)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridStrategy

    L.seed_everything(1234, verbose=False)
    module = _module(model, construction)
    strategy_args = LAYOUTS[layout]
    world = _world(layout)
    data = torch.randint(0, MODELS[model]["vocab_size"], (64, SEQ + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=HybridStrategy(**strategy_args, health_checks=False, monitor=False),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, loader)
    record = {"rank": trainer.global_rank, **module.peaks, "end": peak_rss_bytes(),
              "materialize_peak": trainer.strategy._deferred.peak_bytes}  # fmt: skip
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _world(layout: str) -> int:
    sizes = LAYOUTS[layout]
    dp = 4 if layout == "tp2-dp4-zero3" else 1
    return sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"] * dp


def _planner(model: str, layout: str) -> dict[str, float]:
    """The planner's per-rank ledger for the same sizes, layout and precision (fp32 Adam)."""
    from lightning_hybrid.planning import plan

    sizes = MODELS[model]
    args = LAYOUTS[layout]
    world = _world(layout)
    p = plan(layers=sizes["n_layer"], hidden=sizes["n_embd"], heads=sizes["n_head"], vocab=sizes["vocab_size"],
             seq=SEQ, micro_batch=4 // args["num_microbatches"], precision="32-true", device_memory=1000,
             devices_per_node=world, tensor_parallel_size=args["tensor_parallel_size"],
             pipeline_parallel_size=args["pipeline_parallel_size"], zero_stage=args["zero_stage"],
             num_microbatches=args["num_microbatches"], recompute="none", attention="flash", dropout=False)  # fmt: skip
    ledger = p.layouts[0].ledger
    return {"peak": ledger.peak, "setup": ledger.setup, "model_state": ledger.model_state}


def run_case(model: str, construction: str, layout: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "benchmarks.big_model_memory", "--rank-main", model, construction, layout,
               str(steps), tmp]  # fmt: skip
        # glibc's dynamic mmap threshold grows to 32 MiB once such blocks are freed, after which freed blocks stay
        # in its arenas (one per thread: gloo and autograd run several): resident memory then counts what the process
        # no longer holds. A fixed threshold returns every block of 1 MiB or more to the system when freed.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=3000)
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    import math

    params = 12 * MODELS[model]["n_layer"] * MODELS[model]["n_embd"] ** 2 + 2 * MODELS[model]["vocab_size"] * (
        MODELS[model]["n_embd"]
    )
    return {"model": model, "construction": construction, "layout": layout, "steps": steps,
            "approx_params": params, "full_fp32_bytes": 4 * params, "ranks": ranks,
            "max_first_step": max(r["first_step"] for r in ranks), "max_end": max(r["end"] for r in ranks),
            "planner": _planner(model, layout) if not math.isnan(params) else None}  # fmt: skip


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def report(cases: list[dict[str, Any]]) -> str:
    """The table of docs/benchmarks.md: each case's highest rank. The planner counts the model's memory, not the
    process (interpreter, torch, Lightning: the tiny model's peak), so it is compared with the peak above that."""
    baseline = next((c["max_first_step"] for c in cases if c["model"] == "tiny"), 0)
    header = ("| model | layout | construction | fp32 weights (x ranks) | peak per rank: first step | before the first"
              " optimizer step | after the last step | above the tiny model's | planner's peak | measured / planner |")
    lines = [SECTION_BEGIN, "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        ranks = len(c["ranks"])
        before = max((r.get("before_first_optimizer_step", 0) for r in c["ranks"]), default=0)
        planner = c["planner"]["peak"] if c.get("planner") and c["model"] != "tiny" else None
        above = c["max_end"] - baseline
        ratio = f"{above / planner:.2f}" if planner else "-"
        lines.append(
            f"| {c['model']} | {c['layout']} | {c['construction']} | {_gb(c['full_fp32_bytes'])}"
            f" (x{ranks} = {_gb(c['full_fp32_bytes'] * ranks)}) | {_gb(c['max_first_step'])} |"
            f" {_gb(before) if before else '-'} | {_gb(c['max_end'])} | {_gb(above)} |"
            f" {_gb(planner) if planner else '-'} | {ratio} |"
        )
    lines += ["", SECTION_END]
    return "\n".join(lines)


def write_docs(cases: list[dict[str, Any]]) -> None:
    """Rewrite the section between the markers of docs/benchmarks.md."""
    page = ROOT / "docs" / "benchmarks.md"
    text = page.read_text()
    begin, end = text.find(SECTION_BEGIN), text.find(SECTION_END)
    if begin >= 0 and end >= 0:
        page.write_text(text[:begin] + report(cases) + text[end + len(SECTION_END) :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-main", nargs=5, metavar=("MODEL", "CONSTRUCTION", "LAYOUT", "STEPS", "OUT"))
    parser.add_argument("--big", action="store_true", help="also the model bigger than this machine's memory")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no result files written")
    parser.add_argument("--only", help="one case, MODEL:CONSTRUCTION:LAYOUT:STEPS, merged into the results file")
    args = parser.parse_args(argv)
    if args.rank_main:
        model, construction, layout, steps, out = args.rank_main
        _rank_main(model, construction, layout, int(steps), Path(out))
        return
    out = ROOT / "benchmarks" / "results" / "big_models.json"
    if args.only:
        model, construction, layout, steps = args.only.split(":")
        case = run_case(model, construction, layout, int(steps))
        cases = [c for c in (json.loads(out.read_text()) if out.exists() else [])
                 if (c["model"], c["construction"], c["layout"]) != (model, construction, layout)] + [case]  # fmt: skip
        out.write_text(json.dumps(cases, indent=1))
        write_docs(cases)
        print(report(cases))
        return
    if args.smoke:
        cases = [run_case("smoke", c, "tp2-pp2", 1) for c in ("full", "deferred")]
        print(report(cases))
        return
    cases = [run_case("tiny", "full", "tp2-pp2", 1)]
    cases += [run_case("gpt-0.55b", c, "tp2-pp2", 1) for c in ("full", "deferred")]
    if args.big:
        cases.append(run_case("gpt-0.82b", "deferred", "tp2-dp4-zero3", 3))
    out.write_text(json.dumps(cases, indent=1))
    write_docs(cases)
    print(report(cases))


if __name__ == "__main__":
    main()
