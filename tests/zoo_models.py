"""Causal language models written by others (Hugging Face transformers), built from tiny configs with no weights, in a
LightningModule written for one device: the model's own declared tensor-parallel plan is what the strategy reads."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

# tiny configs; each family's declared plan exercises other transformers style names
FAMILIES: dict[str, dict[str, Any]] = {
    # 'colwise_gather_output' / 'rowwise_split_input' (fused qkv and gate|up sliced in forward)
    "phi3": {"intermediate_size": 64, "num_key_value_heads": 2, "pad_token_id": 0},
    # 'moe_tp_experts' with 'packed_colwise' / 'rowwise' on 3-D expert weights
    "mixtral": {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    # 'replicated_with_grad_allreduce' on the per-head q/k norms
    "qwen3": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8},
    # 'colwise' on a per-head interleaved fused query_key_value, 'embedding_rowwise'
    # (no attention bias: the key bias's true gradient is zero, and Adam turns its rounding noise into full steps)
    "gpt_neox": {"intermediate_size": 64, "attention_bias": False},
    # HF Conv1D projections (transposed weights), a fused c_attn, learned positions, the head tied to the embedding
    "gpt2": {"n_inner": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True},
    # rotary cos/sin computed once outside the blocks and passed to each as a keyword argument
    "llama": {"intermediate_size": 64, "num_key_value_heads": 2},
    # families met from outside the zoo (tests/test_outside_models.py): OPT's layer norms sit beside fc1/fc2 in the
    # decoder layer; Falcon's multi-query fused qkv; BLOOM's ALiBi slopes built outside the blocks; Qwen2-MoE's
    # declared plan names dense-MLP layers that only some layers have; GPTBigCode's c_attn (q|k|v interleaved per
    # head, under a name other families use for three equal blocks)
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "attention_dropout": 0.0, "enable_bias": False},
    "falcon": {
        "new_decoder_architecture": False,
        "multi_query": True,
        "bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "bloom": {"n_head": 4, "n_layer": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "gpt_bigcode": {
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 64,
        "multi_query": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    # expert parallel (tests/test_expert_parallel.py): normalised top-k weights; DeepSeek-V3's shared expert, a dense
    # first layer, sigmoid routing with a correction bias and multi-head latent attention
    "qwen3_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 1,
        "topk_group": 1,
    },
    # more MoE families for expert parallel, found by structure only: OLMoE, GPT-OSS (expert biases, its own gated
    # activation, `router_indices`/`routing_weights`), Granite-MoE (`block_sparse_moe`), ERNIE-4.5-MoE, GLM-4-MoE
    "olmoe": {"intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 2},
    "gpt_oss": {
        "intermediate_size": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "layer_types": ["full_attention", "full_attention"],
    },
    "granitemoe": {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 2},
    "ernie4_5_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "moe_num_experts": 4,
        "moe_k": 2,
        "num_key_value_heads": 2,
        "moe_layer_start_index": 0,
    },
    "glm4_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "head_dim": 8,
    },
    "qwen2_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "qkv_bias": False,
    },
}
COMMON = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False}  # fmt: skip


class _NextTokenLM(L.LightningModule):
    """Next-token cross-entropy and AdamW, as a one-device training script writes them."""

    learning_rate: float

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=0.1)


class HFCausalLM(_NextTokenLM):
    """Any transformers causal LM family from a config, trained from scratch on the test corpus."""

    def __init__(self, family: str, learning_rate: float = 1e-4, example_input: bool = True, **config: Any) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters()
        self.learning_rate = learning_rate
        kwargs = {**COMMON, **FAMILIES.get(family, {}), **config}  # a family met outside: its config in `config`
        config = AutoConfig.for_model(family, **kwargs)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        # without one (example_input=False), nothing can trace the forward before the first batch
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long) if example_input else None
        if family == "gpt2":
            # GPT-2's fused c_attn bias holds the key bias, whose true gradient is zero (Adam turns its rounding noise
            # into full steps): frozen, so the comparison measures the training, not the noise
            for block in self.model.transformer.h:
                block.attn.c_attn.bias.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class HFMaskedLM(_NextTokenLM):
    """An encoder-only model (``bert``, ``roberta``) with its masked-LM head, trained on the next-token targets: the
    forward builds the extended attention mask, token types and positions outside the encoder's block list."""

    def __init__(self, family: str = "bert", learning_rate: float = 1e-4, **config: Any) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForMaskedLM

        self.learning_rate = learning_rate
        kwargs = {**COMMON, "intermediate_size": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "pad_token_id": 0, **config}  # fmt: skip
        config = AutoConfig.for_model(family, **kwargs)
        self.model = AutoModelForMaskedLM.from_config(config, attn_implementation="eager")
        # frozen, as one device would leave them: the key biases' true gradient is zero (Adam turns its rounding noise
        # into full steps), and the head's separate `bias` is unused when the decoder is not tied to the embedding
        for name, p in self.model.named_parameters():
            if name.endswith("attention.self.key.bias") or name == "cls.predictions.bias":
                p.requires_grad_(False)
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits


class HFViT(L.LightningModule):
    """``ViTForImageClassification`` on the 3x8x8 test images (2x2 patches of 4x4): its forward reads
    ``self.embeddings.patch_embeddings.projection.weight.dtype`` before the embeddings run."""

    def __init__(self, learning_rate: float = 1e-4, **config: Any) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        from tests.any_module_models import IMAGE_SHAPE, NUM_CLASSES

        self.learning_rate = learning_rate
        kwargs = {"image_size": IMAGE_SHAPE[1], "patch_size": 4, "num_channels": IMAGE_SHAPE[0], "hidden_size": 32,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                  "num_labels": NUM_CLASSES, "qkv_bias": False, **config}  # fmt: skip
        self.model = ViTForImageClassification(ViTConfig(**kwargs, attn_implementation="eager"))
        self.example_input_array = torch.zeros(2, *IMAGE_SHAPE)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class TorchEncoderLM(_NextTokenLM):
    """A language model built from torch's own ``nn.TransformerEncoder`` (causal mask, pre-norm): no layer name of
    the tensor-parallel names table, and attention inside ``nn.MultiheadAttention``'s fused kernel call."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, heads: int = 4, layers: int = 2, lr: float = 1e-4) -> None:
        super().__init__()
        self.learning_rate = lr
        self.embed = nn.Embedding(vocab_size, dim)
        # no biases: the key bias's true gradient is zero, and Adam turns its rounding noise into full steps
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True, bias=False
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab_size)
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.encoder(self.embed(x), mask=mask, is_causal=True))


def build_zoo_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    """``"hf-<family>"``, ``"hf-bert"``, ``"hf-vit"``, ``"hf-seq2seq-<family>"`` or ``"torch-encoder"`` -> the module;
    ``None`` for other names."""
    if model.startswith("hf-seq2seq-"):
        return HFSeq2SeqLM(model[len("hf-seq2seq-") :], **kwargs)
    if model == "torch-encoder":
        return TorchEncoderLM(**kwargs)
    if model == "hf-vit":
        return HFViT(**kwargs)
    if model in ("hf-bert", "hf-roberta"):
        return HFMaskedLM(model[3:], **kwargs)
    if not model.startswith("hf-"):
        return None
    return HFCausalLM(model[3:], **kwargs)


# encoder-decoder families (tests/test_pipeline_cuts.py): two block lists, the encoder's and the decoder's
SEQ2SEQ: dict[str, dict[str, Any]] = {
    "t5": {"vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
           "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0},
    "bart": {"vocab_size": 128, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64,
             "dropout": 0.0, "attention_dropout": 0.0},
}  # fmt: skip


class HFSeq2SeqLM(_NextTokenLM):
    """An encoder-decoder (``t5``, ``bart``) whose decoder reads the same tokens the encoder does, trained on the
    next-token targets."""

    def __init__(self, family: str = "t5", learning_rate: float = 1e-4, **config: Any) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        self.learning_rate = learning_rate
        config = AutoConfig.for_model(family, **{**SEQ2SEQ[family], **config})
        self.model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=input_ids).logits
