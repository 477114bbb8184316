"""A LightningModule around Hugging Face ``LlamaForCausalLM`` built from a small config (no weights download),
written for one device (no parallel code)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity


class HFLlama(L.LightningModule):
    """A small Llama trained from scratch on the character corpus.

    Example:
        >>> model = HFLlama(vocab_size=128, num_hidden_layers=2)
        >>> model(torch.zeros(1, 8, dtype=torch.long)).shape
        torch.Size([1, 8, 128])
    """

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 256,
        tie_word_embeddings: bool = False,
        learning_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)
        self.example_input_array = torch.zeros(2, 64, dtype=torch.long)  # model summary, pipeline profiling
        # torchmetrics as on one device: HybridStrategy reduces its state over data-parallel replicas only and hands it
        # plain (gathered) logits under tensor parallel
        self.val_perplexity = Perplexity()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_perplexity", self.val_perplexity(logits, y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=0.1)
