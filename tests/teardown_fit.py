"""Run by tests/test_teardown.py as a user runs a script: ``python tests/teardown_fit.py SPEC_JSON`` with
``Trainer(devices=N)`` (Lightning starts the other ranks by running the same command again), or on every rank at once
with ``LOCAL_RANK`` and the rendezvous address set, as a cluster launcher starts it. It fits, then gathers a
result over all ranks and prints it on rank 0: a collective right before the interpreter exits, as in a script that
writes its results, is what leaves gloo's worker threads busy at exit.
"""

from __future__ import annotations

import atexit
import json
import sys
import weakref
from pathlib import Path
from typing import Any, Optional

_world: Optional[weakref.ref[Any]] = None  # the default group, which the results below are gathered over


def _left_alive() -> None:
    # registered before anything else, so it runs after every later atexit handler (they run last-in, first-out)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        sys.stderr.write("LEFT ALIVE: process groups still exist when the interpreter finalizes\n")
    elif _world is not None and _world() is not None:
        # destroyed but still referenced (by this script's trainer and module, as a user's script holds them): gloo
        # stops its threads only when the group is freed, so they would still run into finalization, where a worker
        # releasing the gather's tensors aborts the process at random
        sys.stderr.write("LEFT ALIVE: the default process group is still referenced when the interpreter finalizes\n")


atexit.register(_left_alive)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from tests.harness import Recorder, build_module, full_parameters, make_dataset, trainer_kwargs  # noqa: E402

spec = json.loads(sys.argv[1])
model = spec.get("model", "nanogpt")
module = build_module(model, **({"n_layer": spec.get("n_layer", 2), "bias": False} if model == "nanogpt" else {}))
kwargs = {**trainer_kwargs(1), **spec.get("trainer", {})}
callbacks = []
if spec.get("sigterm_at") is not None:  # every rank gets SIGTERM at the end of this batch, as a cluster sends it

    class Preempted(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            import os
            import signal

            if trainer.global_step == spec["sigterm_at"] + 1:
                os.kill(os.getpid(), signal.SIGTERM)

    callbacks.append(Preempted())
recorder = Recorder()
if spec.get("result"):  # per-step losses (averaged over the data-parallel replicas) and the final parameters

    class Bind(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            data = trainer.strategy.device_mesh["data"]
            recorder.data_group, recorder.data_size = data.get_group(), data.size()

    callbacks += [Bind(), recorder]
trainer = L.Trainer(accelerator="cpu", devices=spec["devices"], strategy=HybridStrategy(**spec["strategy"]),
                    callbacks=callbacks, **kwargs)  # fmt: skip
loader = torch.utils.data.DataLoader(make_dataset(), batch_size=spec.get("batch_size", 4))
try:
    trainer.fit(module, train_dataloaders=loader)
except SystemExit as stop:  # Lightning's SIGTERMException, raised together on every rank
    print(f"STOPPED {type(stop).__name__} rank {trainer.global_rank} step {trainer.global_step}", flush=True)
if spec.get("save"):
    trainer.save_checkpoint(spec["save"])
if spec.get("result"):  # each rank holds its stages' parameters only: merged over every rank's view
    views: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, full_parameters(module))
    if trainer.global_rank == 0:
        environment = type(trainer.strategy.cluster_environment).__name__
        params = {k: v for view in views for k, v in view.items()}
        torch.save({"losses": recorder.losses, "params": params, "environment": environment}, spec["result"])
_world = weakref.ref(torch.distributed.group.WORLD)
losses: list = [None] * torch.distributed.get_world_size()
result = trainer.global_step if spec.get("sigterm_at") is not None else trainer.callback_metrics.get("train_loss", 0.0)
torch.distributed.all_gather_object(losses, float(result))
if trainer.global_rank == 0:
    print("RESULT", json.dumps(losses), flush=True)
