"""Where training goes on after each kind of checkpoint a user can make: one scenario of a shared launch
(``tests/worker.py`` runs it for ``"runner": "resume"``) saves checkpoints of every kind in one layout and resumes from
each in another (or with ``"ddp"`` in both), recording which samples every optimizer step of a resumed fit trained.

The kinds: a ``ModelCheckpoint`` mid-epoch (``every_n_train_steps``) and one at an epoch's end, the ``last.ckpt`` of a
run killed mid-epoch (an exception at the start of a step), ``trainer.save_checkpoint`` after a ``fit(max_steps=...)``
that stopped mid-epoch had returned, and (``"resumable": true``) a mid-epoch checkpoint of a loader that saves and
restores its own position. Each step is fingerprinted by its global batch: the samples of every data-parallel replica
(a pipeline's or tensor peers' copies counted once), so layouts with other data-parallel sizes but the same global
batch compare step by step.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from tests.harness import build_module, make_dataset

SAMPLES = 32
GLOBAL_BATCH = 8  # 4 steps per epoch
TOTAL_STEPS = 8
SAVE_EVERY = 3  # mid-epoch ModelCheckpoints at steps 3 (epoch 0) and 6 (epoch 1)
KILLED_AT = 6  # the killed run stops as step 7 starts; its last.ckpt is step 6's
STOPPED_AT = 3  # fit(max_steps=3) returns mid-epoch 0, then trainer.save_checkpoint()
NOT_RESUMABLE = "your dataloader is not resumable"


def dataset() -> Subset:
    return Subset(make_dataset(), range(SAMPLES))


def sample_key(x: torch.Tensor) -> int:
    """One sample's fingerprint: its tokens (the same in every process: ints hash without a seed)."""
    return hash(tuple(x.tolist()))


class ResumableLoader(DataLoader):
    """A DataLoader that saves and restores its position in the epoch (Lightning's ``state_dict`` /
    ``load_state_dict`` protocol): restored, its next iteration starts after the batches it had yielded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded, self.resume_at = 0, 0

    def __iter__(self) -> Any:
        self.yielded, skip, self.resume_at = self.resume_at, self.resume_at, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["yielded"]


class _Killed(Exception):
    """A run ended from outside (as by SIGTERM/SIGKILL) as a step starts."""


class _KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise _Killed(f"killed as step {self.step + 1} starts")


class _Batches(L.Callback):
    """Per trained batch on this rank: (epoch, batch index, its samples' keys)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, list[int]]] = []
        self.data_rank = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        mesh = getattr(trainer.strategy, "device_mesh", None)
        self.data_rank = mesh["data"].get_local_rank() if mesh is not None else trainer.global_rank

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.seen.append((trainer.current_epoch, idx, [sample_key(x) for x in batch[0]]))


def _global_steps(recorder: _Batches) -> list[tuple[int, int, list[int]]]:
    """Every step's (epoch, batch index, sorted keys of the global batch): the union over data-parallel replicas
    (collective over the world)."""
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (recorder.data_rank, recorder.seen))
    replicas = dict(views)  # one rank per replica: its peers saw the same batches
    steps = zip(*replicas.values())
    return [(s[0][0], s[0][1], sorted(k for _, _, keys in s for k in keys)) for s in steps]


def _fit(
    spec: Any, world: int, directory: Path, steps: int, callbacks: list[L.Callback], ckpt_path: Optional[str] = None,
    resumable: bool = False, batch: int = GLOBAL_BATCH,
) -> tuple[L.Trainer, _Batches, list[str]]:  # fmt: skip
    """One fit of the nanoGPT example; returns the trainer, its batch record and rank 0's warnings."""
    from lightning_hybrid import HybridStrategy

    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    recorder = _Batches()
    checkpoints = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, callbacks=[recorder, *callbacks],
        logger=False, enable_checkpointing=checkpoints, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(directory),
    )  # fmt: skip
    module = build_module("nanogpt", bias=False)
    loader = (ResumableLoader if resumable else DataLoader)(dataset(), batch_size=batch, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        try:
            trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        except _Killed:
            pass
    return trainer, recorder, [str(w.message) for w in caught]


def run(scenario: dict[str, Any], out_dir: Path) -> None:
    """Save every kind of checkpoint with ``scenario["save"]`` and resume from each with ``scenario["resume"]``
    (strategy arguments, or ``"ddp"``); rank 0 saves ``{kind: {"steps": [...], "warnings": [...]}}``."""
    world = int(os.environ["WORLD_SIZE"])
    directory = out_dir / scenario["name"]
    save, resume = scenario["save"], scenario["resume"]
    save_batch, resume_batch = (GLOBAL_BATCH // scenario[f"{k}_dp"] for k in ("save", "resume"))
    sources: dict[str, str] = {}
    if scenario.get("resumable"):
        # a mid-epoch checkpoint of a loader that restores its own position: Lightning restores it
        every = ModelCheckpoint(dirpath=str(directory / "resumable"), every_n_train_steps=SAVE_EVERY, save_top_k=-1)
        _fit(save, world, directory, SAVE_EVERY, [every], resumable=True, batch=save_batch)
        sources["resumable"] = str(directory / "resumable" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    else:
        # one run killed mid-epoch 1: a ModelCheckpoint every 3 steps (and its last.ckpt), one at each epoch's end
        every = ModelCheckpoint(dirpath=str(directory / "steps"), every_n_train_steps=SAVE_EVERY, save_top_k=-1,
                                save_last=True)  # fmt: skip
        epochs = ModelCheckpoint(dirpath=str(directory / "epochs"), every_n_epochs=1, save_on_train_epoch_end=True,
                                 save_top_k=-1)  # fmt: skip
        _fit(save, world, directory, TOTAL_STEPS, [every, epochs, _KillAt(KILLED_AT)], batch=save_batch)
        sources["mid_epoch"] = str(directory / "steps" / f"epoch=0-step={SAVE_EVERY}.ckpt")
        sources["epoch_end"] = str(directory / "epochs" / "epoch=0-step=4.ckpt")
        sources["killed_last"] = str(directory / "steps" / "last.ckpt")
        # a fit that returned mid-epoch, then saved by hand
        trainer, _, _ = _fit(save, world, directory, STOPPED_AT, [], batch=save_batch)
        sources["saved_after_fit"] = str(directory / "saved_after_fit.ckpt")
        trainer.save_checkpoint(sources["saved_after_fit"])
    result = {}
    for kind, path in sources.items():
        callbacks: list[L.Callback] = []
        resumable = kind == "resumable"
        _, recorder, caught = _fit(resume, world, directory, TOTAL_STEPS, callbacks, path, resumable, resume_batch)
        result[kind] = {"steps": _global_steps(recorder), "warnings": caught}
    if dist.get_rank() == 0:
        torch.save(result, out_dir / f"{scenario['name']}.pt")
