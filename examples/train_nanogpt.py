"""Train the nanoGPT example in 3D parallel (tensor x pipeline x data, with ZeRO) on CPU processes.

Lightning launches the processes itself: run the script once, it starts ``tp x pp x dp`` copies of itself.

Example:
    python3 examples/train_nanogpt.py                       # tp=2 x pp=2 x dp=2: 8 CPU processes, 20 steps
    python3 examples/train_nanogpt.py --pipeline-parallel-size 1 --tensor-parallel-size 2 \\
        --data-parallel-size 2 --max-steps 5               # 4 processes
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# `python3 examples/train_nanogpt.py` puts examples/ on sys.path, not the repository root that holds the package
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from examples.data import CharDataModule  # noqa: E402
from examples.nanogpt import NanoGPT  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks that split each layer (default 2)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--data-parallel-size", type=int, default=2, help="model replicas (default 2)")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument(
        "--num-microbatches", type=int, default=4, help="micro-batches per batch when pipeline size > 1 (default 4)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="batch size per data-parallel replica (default 8)")
    parser.add_argument("--log-every", type=int, default=5, help="print the train loss every N steps (default 5)")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


class PrintLoss(L.Callback):
    """Print the (data-parallel averaged) train loss on global rank 0 every ``every`` steps."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        step = trainer.global_step
        if trainer.is_global_zero and loss is not None and (step % self.every == 0 or step == trainer.max_steps):
            print(f"step {step:>4}/{trainer.max_steps}  train_loss {float(loss):.4f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    world = tp * pp * dp
    # one process per "device" on a machine with fewer cores: keep each to its share of threads
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    L.seed_everything(args.seed, verbose=False)  # every rank builds the same initial weights

    data = CharDataModule(block_size=64, batch_size=args.batch_size)
    model = NanoGPT(vocab_size=data.vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=64)

    strategy_kwargs: dict[str, object] = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "data_parallel_size": dp,
        "zero_stage": args.zero_stage,
    }
    if pp > 1:
        strategy_kwargs["num_microbatches"] = args.num_microbatches
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridStrategy(**strategy_kwargs),
        max_steps=args.max_steps,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[PrintLoss(args.log_every)],
    )
    trainer.fit(model, datamodule=data)

    loss = trainer.callback_metrics.get("train_loss")
    if trainer.is_global_zero:
        shown = f"{float(loss):.4f}" if loss is not None else "n/a"
        layout = f"tp={tp} pp={pp} dp={dp} zero_stage={args.zero_stage}"
        print(f"final train_loss {shown} after {trainer.global_step} steps ({layout})")


if __name__ == "__main__":
    main()
