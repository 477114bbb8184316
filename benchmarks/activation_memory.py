"""Activation memory per rank against sequence length: context parallel 1, 2 and 4, each with no, selective and full
recompute, measured in real HybridStrategy runs beside the planner's prediction.

    python -m benchmarks.activation_memory           # 4 CPU processes; writes the figure, JSON and the docs table
    python -m benchmarks.activation_memory --smoke   # two short sequences, nothing written (a quick check)
    python -m benchmarks.activation_memory --from-results   # the planner's column again, beside the saved runs

"Activation memory" is what autograd keeps between one micro-batch's forward and its backward on a rank: every tensor
saved for backward, each storage once, parameters not counted. A checkpointed block keeps what its checkpoint holds
(its input; under ``"selective"`` also the outputs its op policy keeps), which ``saved_tensors_hooks`` does not see
from outside the checkpoint: those are counted where the block is entered and where the policy's ops run. This is the
quantity the planner's activation ledger predicts (the single-process test of the same counting against the ledger is
``tests/test_planning.py::test_activations_within_10_percent_of_saved_tensors``). Each case is one training step of
a HF Llama (fp32, micro-batch 1) under ``HybridStrategy(context_parallel_size=cp, activation_checkpointing=...)``;
at cp1 the 4 processes are data parallel, so every case runs in one group of 4. The highest rank is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORLD = 4
MODEL = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096}  # fmt: skip
SEQUENCES = [256, 512, 1024, 2048]
CONTEXTS = [1, 2, 4]
RECOMPUTES = ["none", "selective", "full"]
FIGURE = ROOT / "docs" / "figures" / "activation-memory-vs-sequence.png"
RESULTS = ROOT / "benchmarks" / "results" / "activation_memory.json"
SECTION_BEGIN = "<!-- activation memory: begin (written by benchmarks/activation_memory.py) -->"
SECTION_END = "<!-- activation memory: end -->"
PAGE = ROOT / "docs" / "context-parallel.md"


@contextmanager
def saved_activation_bytes(module: Any, recompute: str, stages: int = 1) -> Generator[dict[str, Any], None, None]:
    """Count the bytes autograd keeps for backward while the block is active: after it, ``out["bytes"]`` and
    ``out["per_stage"]`` (the share of each of ``stages`` equal pipeline stages of the block list: the embedding counts
    on the first, the head and loss on the last). See the module's docstring for what a checkpointed block counts."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lightning_hybrid.activation_checkpointing import SELECTIVE_SAVED_OPS
    from lightning_hybrid.structure import find_model_structure

    params = {p.untyped_storage().data_ptr() for p in module.parameters() if p.device.type != "meta"}
    seen: list[dict[int, int]] = [{} for _ in range(stages)]
    current, inside = [0], [False]

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    def enter(stage: int, args: tuple) -> None:
        current[0], inside[0] = stage, True
        if recompute != "none" and args and isinstance(args[0], torch.Tensor):
            keep(args[0])  # the checkpoint holds the block's input

    structure = find_model_structure(module)
    per_stage = structure.num_blocks // stages
    handles = []
    for i, name in enumerate(structure.block_names()):
        block = module.get_submodule(name)
        handles.append(block.register_forward_pre_hook(lambda _, args, s=i // per_stage: enter(s, args)))
        handles.append(block.register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    class SelectiveSaves(TorchDispatchMode):
        """The outputs the selective policy keeps, which saved_tensors_hooks outside the checkpoint do not see."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if recompute == "selective" and inside[0] and func.name().split(".")[0] in SELECTIVE_SAVED_OPS:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        keep(t)
            return out

    result: dict[str, Any] = {"bytes": 0, "per_stage": []}
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), SelectiveSaves():
            yield result
    finally:
        for handle in handles:
            handle.remove()
        result["per_stage"] = [sum(s.values()) for s in seen]
        result["bytes"] = sum(result["per_stage"])


def _measured_module(recompute: str) -> Any:
    from examples.hf_llama import HFLlama

    class MeasuredLlama(HFLlama):
        """The example module; its training step counts the bytes its forward leaves for backward."""

        measured: list[int]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            with saved_activation_bytes(self.model, recompute) as saved:
                loss = self._loss(batch)
            self.measured.append(saved["bytes"])
            return loss

    module = MeasuredLlama(**MODEL)
    module.measured = []
    return module


def predicted_bytes(seq: int, cp: int, recompute: str) -> float:
    """The planner's activation ledger for one micro-batch on one rank: a whole-model stage (first and last) of the
    same model with seq / cp tokens, fp32."""
    import torch

    from examples.hf_llama import HFLlama
    from lightning_hybrid.planning import ModelSpec
    from lightning_hybrid.planning.activations import stage_activation_bytes

    with torch.device("meta"):
        module = HFLlama(**MODEL)
    spec = replace(ModelSpec.from_module(module, seq=seq), seq=seq // cp)
    parts = stage_activation_bytes(spec, 1, spec.layers, first=True, last=True, act_bytes=4, recompute=recompute,
                                   context_parallel_size=cp)
    return float(sum(parts.values()))


def _rank_main(cases: list[tuple[int, int, str]], out: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridStrategy

    torch.set_num_threads(1)
    rows = []
    for seq, cp, recompute in cases:
        L.seed_everything(0, verbose=False)
        module = _measured_module(recompute)
        tokens = torch.randint(0, MODEL["vocab_size"], (WORLD // cp, seq + 1))
        data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        sizes = {"context_parallel_size": cp} if cp > 1 else {}
        # verify_tensor_parallel's own forwards are not what is measured here; under context parallel the probe of
        # the loss runs the step before the real one, whose count is the last
        strategy = HybridStrategy(**sizes, zero_stage=1, activation_checkpointing=recompute != "none" and recompute,
                                  verify_tensor_parallel=False)
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
        trainer.fit(module, DataLoader(data, batch_size=1))
        measured = module.measured[-1]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measured)
        rows.append({"seq": seq, "cp": cp, "recompute": recompute, "measured": max(everyone), "ranks": everyone,
                     "predicted": predicted_bytes(seq, cp, recompute)})  # fmt: skip
        if dist.get_rank() == 0:
            print(f"seq {seq} cp{cp} {recompute}: {max(everyone) / 2**20:.1f} MiB", flush=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def run(cases: list[tuple[int, int, str]], timeout: float = 3000) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "cases.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps(cases))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD), "-m",
               "benchmarks.activation_memory", "--rank-main", str(spec), str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=timeout)
        return json.loads(out.read_text())


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RECOMPUTES), figsize=(13, 4.2), sharey=True)
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    for ax, recompute in zip(axes, RECOMPUTES):
        for cp in CONTEXTS:
            mine = sorted((r for r in rows if r["cp"] == cp and r["recompute"] == recompute), key=lambda r: r["seq"])
            if not mine:
                continue
            seqs = [r["seq"] for r in mine]
            ax.plot(seqs, [r["predicted"] / 2**20 for r in mine], "--", color=colors[cp], label=f"cp{cp} planner")
            ax.plot(seqs, [r["measured"] / 2**20 for r in mine], "o", color=colors[cp], label=f"cp{cp} measured")
        ax.set_title(f"recompute: {recompute}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sequence length (tokens per sample)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("activation memory per rank (MiB, one micro-batch)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("HF Llama (4 layers, hidden 128, 8 heads), fp32, micro-batch 1: what autograd keeps per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict[str, Any]]) -> str:
    lines = [SECTION_BEGIN, "", "| sequence | cp | recompute | measured per rank | planner | measured / planner |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["recompute"] != "none", r["recompute"], r["cp"], r["seq"])):
        lines.append(f"| {r['seq']} | {r['cp']} | {r['recompute']} | {r['measured'] / 2**20:.2f} MiB |"
                     f" {r['predicted'] / 2**20:.2f} MiB | {r['measured'] / r['predicted']:.2f} |")  # fmt: skip
    lines += ["", SECTION_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-main", nargs=2, metavar=("CASES", "OUT"))
    parser.add_argument("--smoke", action="store_true", help="two short sequences, nothing written")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated cp sizes")
    parser.add_argument("--from-results", action="store_true",
                        help="no runs: the planner's column recomputed beside the saved measurements, then rewritten")
    args = parser.parse_args(argv)
    if args.rank_main:
        cases = [tuple(c) for c in json.loads(Path(args.rank_main[0]).read_text())]
        _rank_main(cases, Path(args.rank_main[1]))  # type: ignore[arg-type]
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    sequences = [64, 128] if args.smoke else SEQUENCES
    if args.from_results:  # after a change of the planner: the measurements stand
        rows = json.loads(RESULTS.read_text())
        for r in rows:
            r["predicted"] = predicted_bytes(r["seq"], r["cp"], r["recompute"])
    else:
        rows = run([(s, cp, r) for cp in contexts for r in RECOMPUTES for s in sequences])
    print(report(rows))
    if args.smoke:
        return
    RESULTS.write_text(json.dumps(rows, indent=1))
    figure(rows, FIGURE)
    text = PAGE.read_text()
    begin, end = text.find(SECTION_BEGIN), text.find(SECTION_END)
    if begin >= 0 and end >= 0:
        PAGE.write_text(text[:begin] + report(rows) + text[end + len(SECTION_END) :])


if __name__ == "__main__":
    main()
