"""A LightningModule around Hugging Face ``MixtralForCausalLM`` (a mixture of experts) built from a small config (no
weights download), written for one device (no parallel code). ``HybridStrategy(expert_parallel_size=...)`` splits its
experts over data-parallel ranks without a change here (docs/expert-parallel.md)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F


class HFMixtral(L.LightningModule):
    """A small Mixtral trained from scratch: ``num_local_experts`` experts per layer, ``num_experts_per_tok`` chosen
    per token by the router, and the router's load-balancing loss (``router_aux_loss_coef``) added to the
    cross-entropy, as ``MixtralForCausalLM`` computes it.

    Example:
        >>> model = HFMixtral(vocab_size=128, num_hidden_layers=2)
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
        num_local_experts: int = 8,
        num_experts_per_tok: int = 2,
        router_aux_loss_coef: float = 0.01,
        max_position_embeddings: int = 512,
        learning_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        self.save_hyperparameters()
        config = MixtralConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            num_local_experts=num_local_experts,
            num_experts_per_tok=num_experts_per_tok,
            router_aux_loss_coef=router_aux_loss_coef,
            max_position_embeddings=max_position_embeddings,
            attn_implementation="sdpa",
        )
        self.model = MixtralForCausalLM(config)
        self.example_input_array = torch.zeros(2, 64, dtype=torch.long)  # model summary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        coefficient = self.hparams.router_aux_loss_coef
        # every layer's router logits, for the load-balancing loss: asked for only when that loss counts
        out = self.model(input_ids=x, output_router_logits=coefficient > 0)
        loss = F.cross_entropy(out.logits.view(-1, out.logits.size(-1)), y.view(-1))
        if coefficient > 0:
            loss = loss + coefficient * out.aux_loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=0.1)
