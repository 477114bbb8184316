"""How long a checkpoint save blocks training: synchronous vs ``HybridStrategy(async_checkpoint=True)``.

    python benchmarks/checkpoint_async.py                 # 2 CPU processes (dp=2, ZeRO-1), nanoGPT ~13M parameters
    python benchmarks/checkpoint_async.py --devices 4 --tensor-parallel-size 2 --n-embd 512

For each mode the same run trains ``--steps`` steps and calls ``trainer.save_checkpoint`` every ``--save-every``
steps from a callback (as ``ModelCheckpoint`` does). Reported per mode: the median step time without a save, the time
each save blocked the training loop (the ``save_checkpoint`` call on rank 0), and, for async, how long the background
write took and how many training steps started while it was in flight. Results are printed and written as JSON.
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

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402


class SaveTimer(L.Callback):
    """Times every step, and every ``every``-th step saves a checkpoint and times how long the call blocked."""

    def __init__(self, directory: Path, every: int) -> None:
        self.directory, self.every = directory, every
        self.step_seconds: list[float] = []
        self.blocked: list[float] = []
        self.write_seconds: list[float] = []
        self.steps_during_write: list[int] = []
        self._start = 0.0
        self._in_flight: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        future = self._in_flight.get("future")
        if future is not None and not future.done():
            self._in_flight["steps"] += 1  # this step starts while the previous save is still being written
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        writer = trainer.strategy._checkpoint_writer
        if self._in_flight and self._in_flight["future"].done():
            self._finish_write()
        if trainer.global_step % self.every == 0:
            if self._in_flight:
                self._finish_write()
            start = time.perf_counter()
            trainer.save_checkpoint(self.directory / f"step={trainer.global_step}.ckpt")
            self.blocked.append(time.perf_counter() - start)
            if writer._pending is not None:
                self._in_flight = {"start": start, "steps": 0, "future": writer._pending}
                flight = self._in_flight
                writer._pending.add_done_callback(lambda _f: flight.setdefault("end", time.perf_counter()))

    def _finish_write(self) -> None:
        flight, self._in_flight = self._in_flight, {}
        flight["future"].result()
        self.write_seconds.append(flight.get("end", time.perf_counter()) - flight["start"])
        self.steps_during_write.append(flight["steps"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._in_flight:
            self._finish_write()


def run(args: argparse.Namespace, asynchronous: bool, directory: Path) -> dict[str, Any]:
    from examples.data import CharDataModule
    from examples.nanogpt import NanoGPT

    L.seed_everything(1234, verbose=False)
    data = CharDataModule(block_size=64, batch_size=args.batch_size)
    model = NanoGPT(vocab_size=data.vocab_size, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    timer = SaveTimer(directory, args.save_every)
    strategy = HybridStrategy(
        tensor_parallel_size=args.tensor_parallel_size, zero_stage=args.zero_stage, async_checkpoint=asynchronous
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, callbacks=[timer],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    saving_steps = set(range(args.save_every - 1, args.steps, args.save_every))
    plain = [s for i, s in enumerate(timer.step_seconds) if i not in saving_steps and i > 0]
    return {
        "mode": "async" if asynchronous else "sync",
        "parameters": sum(p.numel() for p in model.parameters()),
        "median_step_s": statistics.median(plain),
        "blocked_s": timer.blocked,
        "background_write_s": timer.write_seconds,
        "steps_during_write": timer.steps_during_write,
        "rank": trainer.global_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=6)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "checkpoint_async.json"))
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # launch the processes once (torchrun), both runs inside the same group
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.devices),
               __file__, *sys.argv[1:]]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        raise SystemExit(subprocess.call(cmd, env=env, cwd=ROOT))
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for asynchronous in (False, True):
            results.append(run(args, asynchronous, Path(tmp) / ("async" if asynchronous else "sync")))
    if results[0]["rank"] != 0:
        return
    for r in results:
        blocked = statistics.median(r["blocked_s"])
        line = f"{r['mode']:>5}: step {r['median_step_s'] * 1e3:7.1f} ms, a save blocks {blocked * 1e3:7.1f} ms"
        if r["background_write_s"]:
            write = statistics.median(r["background_write_s"])
            line += f"; written in the background in {write * 1e3:.1f} ms, steps meanwhile {r['steps_during_write']}"
        print(line)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
