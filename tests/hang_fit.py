"""Run by tests/test_reliability.py under ``torchrun``: a 3D fit with a short collective timeout, long enough to be
still training when the test stops one rank. Each rank writes its pid at set-up; the rank to stop writes
``ready`` when it starts step ``stop_at`` (and goes on), which is when the test sends it SIGSTOP.

Usage: torchrun --nproc_per_node N tests/hang_fit.py SPEC_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from tests.harness import build_module, make_dataset, trainer_kwargs  # noqa: E402

spec = json.loads(sys.argv[1])
directory = Path(spec["dir"])


class Marker(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        (directory / f"pid.{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == spec["stop_rank"] and batch_idx == spec["stop_at"]:
            (directory / "ready").write_text(str(os.getpid()))


torch.set_num_threads(1)
# Every rank at the start line before the short collective timeout applies: on a loaded machine the ranks' imports
# end tens of seconds apart, and the first collective would time out on the early ones (a rank exited 1 before
# step 3 once in a full suite). A count in torchrun's store, which its agent hosts, with no process group of its own.
store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=600))  # fmt: skip
store.add("hang_fit.started", 1)
while int(store.add("hang_fit.started", 0)) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.1)
module = build_module("nanogpt", n_layer=2, bias=False)
strategy = HybridStrategy(**spec["strategy"], timeout=spec["timeout"])
kwargs = {**trainer_kwargs(spec.get("steps", 10_000)), "callbacks": [Marker()]}
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, **kwargs)
loader = torch.utils.data.DataLoader(make_dataset(), batch_size=4)
trainer.fit(module, train_dataloaders=loader)
