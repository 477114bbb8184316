"""Peak memory per rank at set-up: a model built whole on every rank against the same model built in
``configure_model`` (deferred: on the meta device, then only this rank's shards), and a model bigger than this
machine's memory would allow if every rank built it whole.

    python -m benchmarks.big_model_memory          # the 0.55B GPT at tp2 x pp2 (4 processes): tiny, full, deferred
    python -m benchmarks.big_model_memory --big    # also a 0.82B GPT at tp2 x dp4, ZeRO-3 (8 processes), 3 steps
    python -m benchmarks.big_model_memory --setup  # the set-up peak per rank against its shards (below)
    python -m benchmarks.big_model_memory --smoke  # tiny sizes, nothing written (a quick check of the script)

Each case is one Lightning run on CPU processes (gloo); each rank records its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) when its first training batch starts and after its last step, and the
planner's per-rank prediction for the same model and layout. Results go to ``benchmarks/results/big_models.json`` and
the "Models bigger than one device" section of ``docs/benchmarks.md`` (between its markers).

``--setup`` measures what docs/big-models.md promises of deferred construction: at the first step, each rank's peak
above the same family's tiny model in the same layout is at most the rank's own shards (its parameters and buffers,
each storage once) plus the model's largest single tensor (the one full tensor the replay has in flight). A 0.55B GPT
and a 0.47B Hugging Face Llama, at tp2 x pp2 and pp2, every rank (first and last stage); results go to
``benchmarks/results/big_models_setup.json`` and docs/big-models.md (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTION_BEGIN = "<!-- big models: begin (written by benchmarks/big_model_memory.py) -->"
SECTION_END = "<!-- big models: end -->"
SETUP_BEGIN = "<!-- set-up peak: begin (written by benchmarks/big_model_memory.py --setup) -->"
SETUP_END = "<!-- set-up peak: end -->"
SEQ = 16

# GPT-style, untied head: 12 * layers * hidden^2 (blocks) + 2 * vocab * hidden (embedding and head)
MODELS = {
    "tiny": {"vocab_size": 128, "n_layer": 2, "n_head": 4, "n_embd": 32},
    "gpt-0.55b": {"vocab_size": 32000, "n_layer": 24, "n_head": 16, "n_embd": 1280},
    "gpt-0.82b": {"vocab_size": 8192, "n_layer": 28, "n_head": 16, "n_embd": 1536},
    "smoke": {"vocab_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 64},
    "gpt-0.12b": {"vocab_size": 8192, "n_layer": 8, "n_head": 16, "n_embd": 1024},
    # the 0.55B GPT's depth at the tiny width: its module tree, hooks and construction record without its tensors
    "tiny-24": {"vocab_size": 128, "n_layer": 24, "n_head": 4, "n_embd": 32},
    "smoke-tiny": {"vocab_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 32},
}
# Hugging Face Llama (untied head), built in configure_model: its post_init initializes every weight a second time
LLAMAS = {
    "llama-tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4},
    "llama-0.47b": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                    "num_attention_heads": 16},
    "llama-smoke": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                    "num_attention_heads": 4},
    "llama-tiny-24": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 24,
                      "num_attention_heads": 4},
    "llama-smoke-tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                         "num_attention_heads": 4},
}  # fmt: skip
TINY = {"gpt": "tiny", "llama": "llama-tiny"}
# each measured model's depth at the tiny width: the baseline of the set-up bound, so that what is left above it is
# tensor memory (the bound's terms), not the Python objects of a deeper module tree
SAME_DEPTH_TINY = {"gpt-0.55b": "tiny-24", "llama-0.47b": "llama-tiny-24", "smoke": "smoke-tiny",
                   "llama-smoke": "llama-smoke-tiny"}  # fmt: skip
BASELINES = set(TINY.values()) | set(SAME_DEPTH_TINY.values())
SETUP_MODELS = ("gpt-0.55b", "llama-0.47b")
LAYOUTS = {
    "tp2-pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1, "num_microbatches": 2},
    # 8 processes. (2x2x2 with ZeRO-3 keeps each stage's parameters gathered over data, plus under "per_step" an
    # unsharded copy of its gradients, for the whole step: about 3.6 GB a rank for this model, more than this
    # machine's 24 GB holds for 8 ranks)
    "tp2-dp4-zero3": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "zero_stage": 3, "num_microbatches": 1},
    "pp2": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "zero_stage": 1, "num_microbatches": 2},
}  # fmt: skip


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def rss_bytes() -> int:
    """Resident memory now (``VmRSS``; 0 where /proc is not there)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def _vocab(model: str) -> int:
    return (LLAMAS.get(model) or MODELS[model])["vocab_size"]


def _module(model: str, construction: str) -> Any:
    import lightning as L
    import torch

    from examples.nanogpt import GPT, GPTConfig, NanoGPT

    def build() -> Any:
        if model in LLAMAS:
            from transformers import LlamaConfig, LlamaForCausalLM

            return LlamaForCausalLM(LlamaConfig(**LLAMAS[model], max_position_embeddings=2 * SEQ))
        sizes = MODELS[model]
        config = GPTConfig(sizes["vocab_size"], SEQ, sizes["n_layer"], sizes["n_head"], sizes["n_embd"], 0.0, False)
        return GPT(config)

    class Measured(NanoGPT):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)  # not NanoGPT's: where the network is built is the variable here
            self.save_hyperparameters({"learning_rate": 1e-4, "weight_decay": 0.1})
            self.model = build() if construction == "full" else None
            self.example_input_array = None
            self.peaks: dict[str, int] = {}

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build()

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            out = self.model(idx)
            return out.logits if model in LLAMAS else out

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.peaks["first_step"] = peak_rss_bytes()
                self.peaks["resident_first_step"] = rss_bytes()  # what the rank holds then: the peak less transients

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.peaks.setdefault("before_first_optimizer_step", peak_rss_bytes())

        def validation_step(self, *args: Any) -> None:
            return None

    return Measured()


def held_bytes(module: Any) -> tuple[int, int]:
    """(this rank's parameters and buffers in bytes, each storage once: its shards; the largest single tensor it
    holds a part of, in full)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    shards = largest = 0
    for t in [*module.parameters(), *module.buffers()]:
        largest = max(largest, t.numel() * t.element_size())  # a DTensor's numel is the whole tensor's
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            shards += storage.nbytes()
    return shards, largest


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
    data = torch.randint(0, _vocab(model), (64, SEQ + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=HybridStrategy(**strategy_args, health_checks=False, monitor=False),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, loader)
    shards, largest = held_bytes(module)
    record = {"rank": trainer.global_rank, **module.peaks, "end": peak_rss_bytes(),
              "materialize_peak": trainer.strategy._deferred.peak_bytes, "shards": shards, "largest": largest,
              "stage": trainer.strategy.device_mesh["pipeline"].get_local_rank()}  # fmt: skip
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
        # rank 0 is the command Lightning's launcher started the others from: it may return before they wrote
        deadline = time.monotonic() + 300
        while len(list(Path(tmp).glob("rank*.json"))) < _world(layout) and time.monotonic() < deadline:
            time.sleep(1)
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
        assert len(ranks) == _world(layout), f"{len(ranks)} of {_world(layout)} ranks reported"
    import math

    if model in LLAMAS:
        c = LLAMAS[model]
        h, layers = c["hidden_size"], c["num_hidden_layers"]
        params = layers * (4 * h * h + 3 * h * c["intermediate_size"]) + 2 * c["vocab_size"] * h
    else:
        params = 12 * MODELS[model]["n_layer"] * MODELS[model]["n_embd"] ** 2 + 2 * MODELS[model]["vocab_size"] * (
            MODELS[model]["n_embd"]
        )
    return {"model": model, "construction": construction, "layout": layout, "steps": steps,
            "approx_params": params, "full_fp32_bytes": 4 * params, "ranks": ranks,
            "max_first_step": max(r["first_step"] for r in ranks), "max_end": max(r["end"] for r in ranks),
            "planner": _planner(model, layout) if model not in LLAMAS and not math.isnan(params) else None}  # fmt: skip


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


def setup_rows(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank of each deferred case: its first-step peak above the same rank of a tiny model of the same family and
    depth in the same layout, against its shards plus the model's largest tensor (the bound docs/big-models.md
    states); and, for comparison, above the family's 2-layer tiny model."""
    tiny = {(c["model"], c["layout"]): {r["rank"]: r["first_step"] for r in c["ranks"]} for c in cases}
    rows = []
    for c in cases:
        if c["model"] in BASELINES or c["construction"] != "deferred":
            continue
        family = "llama" if c["model"] in LLAMAS else "gpt"
        baseline = tiny[(SAME_DEPTH_TINY[c["model"]], c["layout"])]
        shallow = tiny[(TINY[family], c["layout"])]
        largest = max(r["largest"] for r in c["ranks"])  # of the whole model: some rank holds a part of it
        for r in sorted(c["ranks"], key=lambda r: r["rank"]):
            above = r["first_step"] - baseline[r["rank"]]
            bound = r["shards"] + largest
            rows.append({"model": c["model"], "layout": c["layout"], "rank": r["rank"], "stage": r["stage"],
                         "first_step": r["first_step"], "tiny": baseline[r["rank"]], "above": above,
                         "above_shallow": r["first_step"] - shallow[r["rank"]],
                         "shards": r["shards"], "largest": largest, "bound": bound, "holds": above <= bound,
                         "replay": r["materialize_peak"],
                         "transient": r["first_step"] - r.get("resident_first_step", r["first_step"])})  # fmt: skip
    return rows


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"


def setup_report(cases: list[dict[str, Any]]) -> str:
    header = ("| model | layout | rank (stage) | peak at the first step | same-depth tiny model's | above it | rank's"
              " shards | largest tensor | shards + largest | within | above the 2-layer tiny model's |"
              " peak less resident then | replay's most at once |")
    lines = [SETUP_BEGIN, "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in setup_rows(cases):
        over = r["above"] - r["bound"]
        within = "yes" if r["holds"] else f"no (+{_mib(over) if over >= 2**20 else f'{over / 2**10:.0f} KiB'})"
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['rank']} ({r['stage']}) | {_mib(r['first_step'])} |"
            f" {_mib(r['tiny'])} | {_mib(r['above'])} | {_mib(r['shards'])} | {_mib(r['largest'])} |"
            f" {_mib(r['bound'])} | {within} | {_mib(r['above_shallow'])} |"
            f" {_mib(r['transient'])} | {_mib(r['replay'])} |"
        )
    lines += ["", SETUP_END]
    return "\n".join(lines)


def _write_section(page: Path, begin_marker: str, end_marker: str, section: str) -> None:
    text = page.read_text()
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin >= 0 and end >= 0:
        page.write_text(text[:begin] + section + text[end + len(end_marker) :])


def setup_cases(smoke: bool, models: tuple[str, ...] = SETUP_MODELS) -> list[dict[str, Any]]:
    """Each model, its family's 2-layer tiny model and a tiny one of its depth, built in configure_model, at tp2 x pp2
    and pp2: 1 step."""
    models = ("smoke", "llama-smoke") if smoke else models
    cases = []
    for layout in ("tp2-pp2", "pp2"):
        for model in models:
            tiny = TINY["llama" if model in LLAMAS else "gpt"]
            cases += [run_case(m, "deferred", layout, 1) for m in (tiny, SAME_DEPTH_TINY[model], model)]
    return cases


def write_docs(cases: list[dict[str, Any]]) -> None:
    """Rewrite the section between the markers of docs/benchmarks.md."""
    _write_section(ROOT / "docs" / "benchmarks.md", SECTION_BEGIN, SECTION_END, report(cases))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-main", nargs=5, metavar=("MODEL", "CONSTRUCTION", "LAYOUT", "STEPS", "OUT"))
    parser.add_argument("--big", action="store_true", help="also the model bigger than this machine's memory")
    parser.add_argument("--setup", nargs="?", const=True, metavar="MODELS",
                        help="the set-up peak per rank against its shards (of MODELS, comma-separated: merged into the"
                        f" results; default {','.join(SETUP_MODELS)})")  # fmt: skip
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
    if args.setup:
        models = tuple(args.setup.split(",")) if isinstance(args.setup, str) else SETUP_MODELS
        cases = setup_cases(args.smoke, models)
        if not args.smoke:
            results = ROOT / "benchmarks" / "results" / "big_models_setup.json"
            new = {(c["model"], c["layout"]) for c in cases}
            kept = [c for c in (json.loads(results.read_text()) if results.exists() else [])
                    if (c["model"], c["layout"]) not in new]  # fmt: skip
            cases = kept + cases
            results.write_text(json.dumps(cases, indent=1))
            _write_section(ROOT / "docs" / "big-models.md", SETUP_BEGIN, SETUP_END, setup_report(cases))
        print(setup_report(cases))
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
