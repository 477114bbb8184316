"""Modules for the losses users compute on a language model's logits (issue 44 item 1): written for these tests, not
one of the models the package tests elsewhere.

:class:`LossLab` is a small pre-norm transformer (separate q/k/v projections, a gated MLP, learned positions, an
untied head over a vocabulary of 64) whose ``training_step`` calls the network once and computes the loss named by
``loss`` from the logits, the way such losses are written for one device. The distillation and preference losses
read a fixed "teacher": a random table of next-token logits per input token (a buffer, the same in every process).
:class:`HFLabelsLab` is a Hugging Face Mistral model given ``labels=`` (some ignored with -100) and
``num_items_in_batch``, so that transformers computes the loss inside the network's forward with
``reduction="sum"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 64


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, 2 * width, bias=False)
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(width, bias=False), Attention(width, heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(width, bias=False), GatedMLP(width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _cross_entropy(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _nll_of_log_softmax(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    return F.nll_loss(F.log_softmax(logits, dim=-1).flatten(0, 1), y.flatten())


def _label_smoothing(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    # torch's argument, with the classes on dimension 1 as F.cross_entropy takes a [B, C, T] input
    return F.cross_entropy(logits.transpose(1, 2), y, label_smoothing=0.1)


def _label_smoothing_written(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    log_probs = logits.log_softmax(-1)
    return 0.9 * F.nll_loss(log_probs.view(-1, log_probs.size(-1)), y.view(-1)) - 0.1 * log_probs.mean()


def _distillation(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    temperature = 2.0
    student = F.log_softmax(logits / temperature, dim=-1)
    teacher = F.log_softmax(m.teacher[x] / temperature, dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2
    return 0.5 * kl + 0.5 * _cross_entropy(m, logits, x, y)


def _preference(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    # DPO over pairs of samples (chosen = even, rejected = odd), the teacher as the frozen reference policy
    def sequence_log_probs(scores: Tensor) -> Tensor:
        return scores.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1).sum(-1)

    policy, reference = sequence_log_probs(logits), sequence_log_probs(m.teacher[x]).detach()
    margin = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    return -F.logsigmoid(0.1 * margin).mean()


def _z_loss_and_entropy(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    log_probs = F.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    return _cross_entropy(m, logits, x, y) + 1e-2 * z_loss - 1e-2 * entropy


def _mse(m: LossLab, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(logits, m.teacher[x])


LOSSES: dict[str, Callable[[Any, Tensor, Tensor, Tensor], Tensor]] = {
    "cross_entropy": _cross_entropy,
    "nll_log_softmax": _nll_of_log_softmax,
    "label_smoothing": _label_smoothing,
    "label_smoothing_written": _label_smoothing_written,
    "distillation": _distillation,
    "preference": _preference,
    "z_loss_entropy": _z_loss_and_entropy,
    "mse": _mse,
}


class LossLab(L.LightningModule):
    """The transformer above with the loss ``loss`` (a name of ``LOSSES``, or ``"all"``: their sum) computed in
    ``training_step`` from the logits. Also logs the token accuracy (an argmax of the logits) and keeps each
    step's number of logits gathers (``gathers``: how many times split logits were made whole)."""

    def __init__(
        self,
        loss: str = "cross_entropy",
        vocab_size: int = VOCAB,
        width: int = 32,
        heads: int = 4,
        layers: int = 2,
        length: int = 16,
        learning_rate: float = 1e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyLM(vocab_size, width, heads, layers, length)
        self.register_buffer("teacher", torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(7)))
        self.example_input_array = torch.zeros(2, length, dtype=torch.long)
        self.gathers: list[int] = []

    def forward(self, ids: Tensor) -> Tensor:
        return self.net(ids)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

        x, y = batch
        logits = self(x)
        # counted from the network's output on (under a pipeline the micro-batches' steps interleave around their
        # network calls, and a first-step check of the network may gather its output inside the call)
        before = VocabParallelLogits.gathers
        names = list(LOSSES) if self.hparams.loss == "all" else [self.hparams.loss]
        loss = sum(LOSSES[name](self, logits, x, y) for name in names)
        self.gathers.append(VocabParallelLogits.gathers - before)
        self.log("train_accuracy", (logits.argmax(-1) == y).float().mean(), sync_dist=True)
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class HFLabelsLab(L.LightningModule):
    """A Hugging Face Mistral causal LM whose loss transformers computes inside the forward: ``labels=`` with the first
    ``ignored`` tokens of each sample at -100 and ``num_items_in_batch`` (a sum over the kept tokens, divided by
    their count), as trainers that accumulate micro-batches call it."""

    def __init__(self, ignored: int = 3, learning_rate: float = 1e-4, **config: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import MistralConfig, MistralForCausalLM

        defaults = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                    "tie_word_embeddings": False}  # fmt: skip
        self.model = MistralForCausalLM(MistralConfig(**{**defaults, **config}))
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)
        self.gathers: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        labels = x.clone()
        labels[:, : self.hparams.ignored] = -100
        # transformers shifts the labels itself: each sample keeps len - ignored tokens (the last has no next one)
        kept = torch.tensor(x.shape[0] * (x.shape[1] - self.hparams.ignored), device=x.device)
        from lightning_hybrid.tensor_parallel.vocab import VocabParallelLogits

        before = VocabParallelLogits.gathers
        loss = self.model(input_ids=x, labels=labels, num_items_in_batch=kept).loss
        self.gathers.append(VocabParallelLogits.gathers - before)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


def build_loss_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``"losslab"`` or ``"hf_labels"`` (tests/harness.py's ``build_module`` seeds first); None for other names."""
    if model == "losslab":
        return LossLab(**kwargs)
    if model == "hf_labels":
        return HFLabelsLab(**kwargs)
    return None
