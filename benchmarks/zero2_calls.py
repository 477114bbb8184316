"""Collectives per gradient bucket at ZeRO-2: one optimizer step of the benchmarks' 4-block model metered by
:class:`~lightning_hybrid.monitoring.CommunicationMeter`, the data-parallel calls counted against the buckets.

    PYTHONPATH=. torchrun --standalone --nproc_per_node 4 benchmarks/zero2_calls.py [--bucket-cap-mb 1]

Rank 0 prints one line: the data-parallel size, the buckets, and each data-parallel collective's calls and bytes in
the metered step (the gradients' reduction, bucket by bucket during backward, and the parameters' all-gather after
the step). The package and the example are imported from ``PYTHONPATH``, so the same script measures any tree.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

MODEL = {"vocab_size": 128, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}  # compare.py's "dense"


class _Metered(L.Callback):
    """The communication of optimizer step ``step``, per (dimension, collective): (calls, bytes)."""

    def __init__(self, step: int) -> None:
        self.step, self.meter, self.counted = step, None, {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_hybrid.monitoring import CommunicationMeter

        if trainer.global_step == self.step:
            self.meter = CommunicationMeter(trainer.strategy.device_mesh).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.counted = {f"{d}/{op}": (s.calls, s.bytes) for (d, op), s in self.meter.totals().items()}
            self.meter = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    args = parser.parse_args()
    from examples.nanogpt import NanoGPT
    from lightning_hybrid import HybridStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (64, MODEL["block_size"] + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    metered = _Metered(step=1)
    strategy = HybridStrategy(zero_stage=2, bucket_cap_mb=args.bucket_cap_mb, monitor=False, health_checks=False)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                        strategy=strategy, max_steps=2, callbacks=[metered], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(NanoGPT(**MODEL), train_dataloaders=data)
    if trainer.global_rank == 0:
        buckets = len(strategy.gradient_buckets[0])
        data_calls = {k.split("/", 1)[1]: v for k, v in metered.counted.items() if k.startswith("data/")}
        print(json.dumps({"dp": strategy.device_mesh["data"].size(), "buckets": buckets, "data": data_calls}))


if __name__ == "__main__":
    main()
