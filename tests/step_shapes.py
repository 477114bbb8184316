"""Training steps shaped as users write them, each run under a layout and under Lightning's ``"ddp"``.

A user's ``training_step`` is more than "call the network once, return a cross-entropy": it draws random masks and
noise before the network, calls the network twice (two views, a chosen and a rejected answer), reads a frozen second
network, counts its calls on ``self``, logs with every ``reduce_fx``. :class:`StepShapes` is one small language model
(written for one device) whose step is one of those shapes, chosen by ``shape``:

* ``"draws"``: BERT-style masking and diffusion-style noise in one step: a random mask (``torch.rand``) replaces
  tokens by a mask id, random noise tokens (``torch.randint``) replace whole samples chosen by a per-sample switch;
  the loss reads the masked positions (``logits[mask]``, a boolean mask's data-dependent shape) and the noise it must
  predict;
* ``"pair"``: a DPO-style preference loss: the network on a chosen and a rejected sequence (two calls coupled in one
  loss), log-probabilities gathered at the tokens, and a frozen reference network that is not the one split;
* ``"views"``: two views of each sample (the second drawn at random before the calls), cross-entropy on the first and
  a consistency term between the two calls' log-probabilities (an MSE on them).

Every shape counts its calls on ``self`` and appends to a list before its network call and to another after it (side
effects), returns its predictions beside the loss (read in ``on_train_batch_end``), keeps validation predictions on
``self`` for ``on_validation_epoch_end``, logs its loss with ``reduce_fx`` sum,
mean, max and min (``sync_dist``), a value with an explicit ``batch_size`` and a torchmetrics object, in training and
validation; ``predict_step`` returns the argmax of the logits. ``run_step_shapes`` runs one scenario in a shared launch:
each call of the step sees two samples and an optimizer step takes two calls per replica, whatever the layout (a
pipeline's batch of four in two micro-batches, or batches of two accumulated twice), so one ``"ddp"`` run with the
same data-parallel size is the truth for every layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Subset

from examples.nanogpt import GPT, GPTConfig
from tests.harness import SEED, make_dataset

VOCAB = 128  # make_dataset's characters fit
CALL_SAMPLES = 2  # samples a call of the step sees
CALLS_PER_STEP = 2  # calls of the step an optimizer step takes, per replica
OPTIMIZER_STEPS = 3
VAL_CALLS = 2
MASK_ID = 0


class StepShapes(L.LightningModule):
    """A small GPT whose ``training_step`` is one of the shapes in the module's docstring."""

    def __init__(self, shape: str, n_layer: int = 4, seed_per_rank: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(VOCAB, 16, n_layer, n_head=2, n_embd=16, dropout=0.0, bias=False))
        if shape == "pair":  # a frozen reference network, not the one the strategy splits
            self.reference = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)).requires_grad_(False)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.calls, self.calls_after = 0, 0
        self.seen: list[int] = []
        self.after: list[int] = []
        self.train_preds: list[torch.Tensor] = []  # the step's returned predictions, as on_train_batch_end gets them
        self.val_outputs: list[torch.Tensor] = []  # kept by validation_step, read in on_validation_epoch_end

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def on_fit_start(self) -> None:
        if self.hparams.seed_per_rank:  # each process its own stream, as users seed augmentations per rank
            torch.manual_seed(SEED + self.global_rank)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, logits of the first call, targets), computed as the shape says."""
        x, y = batch
        shape = self.hparams.shape
        if shape == "draws":
            masked = torch.rand(x.shape, device=x.device) < 0.3
            noise = torch.randint(1, VOCAB, x.shape, device=x.device)
            noisy = torch.rand(x.shape[0], 1, device=x.device) < 0.5
            inputs = torch.where(noisy, noise, x.masked_fill(masked, MASK_ID))
            logits = self(inputs)
            targets = torch.where(noisy, noise, x)
            picked = masked | noisy  # the masked positions, and every position of a noisy sample
            return F.cross_entropy(logits[picked], targets[picked]), logits, targets
        if shape == "pair":
            rejected = (y + torch.randint(1, VOCAB, y.shape, device=y.device)) % VOCAB
            chosen_logits, rejected_logits = self(x), self(x.roll(1, dims=1))
            with torch.no_grad():
                reference_chosen, reference_rejected = self.reference(x), self.reference(x.roll(1, dims=1))

            def log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
                return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).sum(-1)

            margin = (log_probs(chosen_logits, y) - log_probs(reference_chosen, y)) - (
                log_probs(rejected_logits, rejected) - log_probs(reference_rejected, rejected)
            )
            loss = -F.logsigmoid(0.1 * margin).mean() + F.cross_entropy(chosen_logits.flatten(0, 1), y.flatten())
            return loss, chosen_logits, y
        if shape == "views":
            shift = int(torch.randint(1, 4, ()))  # the second view, drawn before the calls
            first, second = self(x), self(x.roll(shift, dims=1))
            consistency = F.mse_loss(first.log_softmax(-1), second.roll(-shift, dims=1).log_softmax(-1))
            return F.cross_entropy(first.flatten(0, 1), y.flatten()) + 0.1 * consistency, first, y
        raise ValueError(shape)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.calls += 1
        self.seen.append(batch_idx)
        loss, logits, _ = self._loss(batch)
        self.after.append(batch_idx)  # after the network: the earlier pipeline stages run this on stand-ins
        self.calls_after += 1
        for fx in ("sum", "mean", "max", "min"):
            self.log(f"train_loss_{fx}", loss, on_step=False, on_epoch=True, reduce_fx=fx, sync_dist=True)
        self.log("train_loss_sized", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]), sync_dist=True)
        return {"loss": loss, "preds": logits.argmax(-1)}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train_preds.append(outputs["preds"].cpu())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, targets = self._loss(batch)
        self.val_outputs.append(logits.argmax(-1))  # kept on self after the call: real on every pipeline stage
        self.val_acc(logits.argmax(-1).flatten(), targets.flatten())
        self.log("val_acc", self.val_acc)
        for fx in ("sum", "max"):
            self.log(f"val_loss_{fx}", loss, reduce_fx=fx, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        kept = torch.cat(self.val_outputs).float()
        self.log("val_kept_sum", kept.sum(), reduce_fx="sum", sync_dist=True)
        self.val_outputs.clear()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def run_step_shapes(scenario: dict[str, Any], out_dir: Path) -> None:
    """One scenario on every rank: fit, then predict; rank 0 saves every rank's record (see the module docstring)."""
    from lightning_hybrid import HybridStrategy
    from tests.features import _data_rank, _floats, _parameters, _RecordingLogger, _save_per_rank

    world = int(os.environ["WORLD_SIZE"])
    spec = scenario["strategy"]
    microbatches = 1 if isinstance(spec, str) else spec.get("num_microbatches", 1)
    accumulate = CALLS_PER_STEP // microbatches
    batch_size = CALL_SAMPLES * microbatches
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    L.seed_everything(SEED, verbose=False)
    module = StepShapes(scenario["shape"], seed_per_rank=scenario.get("seed_per_rank", False))
    logger = _RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, logger=logger, max_epochs=1,
        limit_train_batches=OPTIMIZER_STEPS * accumulate, limit_val_batches=VAL_CALLS // microbatches,
        accumulate_grad_batches=accumulate, log_every_n_steps=1, num_sanity_val_steps=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out_dir / scenario["name"]),
    )  # fmt: skip
    data = make_dataset()
    evaluation = DataLoader(Subset(data, range(2 * VAL_CALLS * CALL_SAMPLES)), batch_size=batch_size)
    trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=True), val_dataloaders=evaluation)
    runner = getattr(getattr(trainer.strategy, "parallelized", None), "runner", None)
    fitted = {"calls": module.calls, "calls_after": module.calls_after, "seen": list(module.seen),
              "after": list(module.after),
              "train_preds": torch.cat(module.train_preds),
              "holds_output": runner is None or runner.last_stage in runner.stages,
              "epoch_values": _floats(trainer.callback_metrics)}  # fmt: skip
    predictions = trainer.predict(module, dataloaders=DataLoader(Subset(data, range(8)), batch_size=batch_size))
    record = {
        **fitted,
        "predictions": torch.cat([p.cpu() for p in predictions]),
        "data_rank": _data_rank(trainer),
        "params": _parameters(module),
        "world": world,
    }
    _save_per_rank(record, world, out_dir / f"{scenario['name']}.pt")
    if dist.is_initialized():
        dist.barrier()
