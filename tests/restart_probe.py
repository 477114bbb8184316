"""A callback for tests/test_reliability.py's restart test, added to a ``lightning-hybrid fit`` run on the command
line: every rank appends ``attempt step`` to ``steps.rank<R>`` (in the working directory) after each optimizer step,
and rank ``kill_rank`` SIGKILLs itself just before step ``kill_at`` of the first attempt (torchrun's restart count
0), as a rank dying mid-run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L


class StepLog(L.Callback):
    def __init__(self, kill_rank: int = 1, kill_at: int = 9) -> None:
        self.kill_rank, self.kill_at = kill_rank, kill_at
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.attempt == 0 and trainer.global_rank == self.kill_rank and trainer.global_step + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with Path(f"steps.rank{trainer.global_rank}").open("a") as f:
            f.write(f"{self.attempt} {trainer.global_step}\n")
