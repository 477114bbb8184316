"""What a paused step holds: peak memory per rank when each micro-batch's step keeps a large local from before its
network call to after it, under pipeline parallel (the steps of a batch pause together) and under "ddp".

Under a pipeline every micro-batch's step runs up to its network call before the schedule and resumes when the
schedule reaches it (docs/step-semantics.md), so the locals the steps made before the call live together: a step
that makes an L-byte tensor before its network call and reads it after holds m x L on a rank (m micro-batches),
where "ddp" with the micro-batches accumulated holds L. This measures it: the step of a tiny GPT makes a
``local_mb`` MB tensor before its network call and adds it into the loss after; one fit with ``local_mb`` and one
without, in fresh processes, on two CPU processes; the difference of each rank's peak RSS (``resource.getrusage``).

    python -m benchmarks.paused_step_memory                  # pp2 (1F1B, 4 micro-batches) and ddp, 64 MB locals
    python -m benchmarks.paused_step_memory --local-mb 128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MICROBATCHES = 4


def _fit(layout: str, local_mb: int, out: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from examples.nanogpt import NanoGPT
    from lightning_hybrid import HybridStrategy
    from tests.harness import make_dataset

    class HoldingGPT(NanoGPT):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            held = torch.ones(local_mb * 2**18) if local_mb else None  # float32: local_mb MB, made before the call
            logits = self(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            return loss + (held[0] * 0 if held is not None else 0)  # read after the call: alive across it

    L.seed_everything(0, verbose=False)
    module = HoldingGPT(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    pipelined = layout == "pp2"
    strategy = (
        HybridStrategy(pipeline_parallel_size=2, num_microbatches=MICROBATCHES, monitor=False) if pipelined else "ddp"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=1 if pipelined else MICROBATCHES,
    )  # fmt: skip
    batch = 2 * MICROBATCHES if pipelined else 2
    trainer.fit(module, DataLoader(make_dataset(), batch_size=batch, shuffle=True))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    path = out / f"{layout}-{local_mb}-rank{trainer.global_rank}.json"
    path.write_text(json.dumps({"peak_mb": peak_mb}))


def _launch(layout: str, local_mb: int, out: Path) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.paused_step_memory", "--run", layout, str(local_mb), str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
    return {r: json.loads((out / f"{layout}-{local_mb}-rank{r}.json").read_text())["peak_mb"] for r in (0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-mb", type=int, default=64)
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        layout, local_mb, out = args.run
        _fit(layout, int(local_mb), Path(out))
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for layout in ("pp2", "ddp"):
            base, held = _launch(layout, 0, out), _launch(layout, args.local_mb, out)
            deltas = {r: held[r] - base[r] for r in (0, 1)}
            print(
                f"{layout}: a {args.local_mb} MB local held across the network call adds"
                + "".join(f" {d:.0f} MB (rank {r})" for r, d in deltas.items())
                + f" to the peak RSS ({MICROBATCHES} micro-batches a step)"
            )


if __name__ == "__main__":
    main()
