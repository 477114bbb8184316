"""Modules that build their network in ``configure_model``, as Lightning documents for models too big for one
device: the same networks as the examples (nanoGPT, a Hugging Face Llama), litgpt's GPT, and a network written for
none of them (truncated-normal and orthogonal initializations), each constructed where HybridStrategy can defer it.

The single-process reference runs the same class: Lightning calls ``configure_model`` on one device too.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from examples.hf_llama import HFLlama
from examples.hf_mixtral import HFMixtral
from examples.nanogpt import GPT, GPTConfig, NanoGPT
from tests.foreign_models import LITGPT_CONFIGS, LitGPTModule


class DeferredNanoGPT(NanoGPT):
    """The nanoGPT example with its network built in ``configure_model``."""

    def __init__(self, vocab_size: int = 128, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 64, dropout: float = 0.0, bias: bool = True, tie_weights: bool = False,
                 learning_rate: float = 1e-3, weight_decay: float = 0.1) -> None:  # fmt: skip
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        L.LightningModule.__init__(self)  # not NanoGPT's: it builds the network
        self.save_hyperparameters(arguments)
        self.model: nn.Module | None = None
        self.example_input_array = torch.zeros(2, block_size, dtype=torch.long)
        self.val_perplexity = Perplexity()

    def configure_model(self) -> None:
        if self.model is None:  # Lightning calls it again for validate/test/predict
            h = self.hparams
            config = GPTConfig(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout, h.bias,
                               h.tie_weights)  # fmt: skip
            self.model = GPT(config)


class DeferredHFLlama(HFLlama):
    """The Hugging Face Llama example with ``LlamaForCausalLM(config)`` built in ``configure_model``."""

    def __init__(self, **kwargs: Any) -> None:
        L.LightningModule.__init__(self)  # not HFLlama's: it builds the network
        defaults = {n: p.default for n, p in inspect.signature(HFLlama.__init__).parameters.items() if n != "self"}
        self.save_hyperparameters({**defaults, **kwargs})
        self.model: nn.Module | None = None
        self.example_input_array = torch.zeros(2, 64, dtype=torch.long)
        self.val_perplexity = Perplexity()

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            h = {**self.hparams}
            h.pop("learning_rate", None)
            self.model = LlamaForCausalLM(LlamaConfig(**h, attn_implementation="sdpa"))


class DeferredHFMixtral(HFMixtral):
    """The Hugging Face Mixtral example (a mixture of experts, with the router's load-balancing loss) with
    ``MixtralForCausalLM(config)`` built in ``configure_model``."""

    def __init__(self, **kwargs: Any) -> None:
        L.LightningModule.__init__(self)  # not HFMixtral's: it builds the network
        defaults = {n: p.default for n, p in inspect.signature(HFMixtral.__init__).parameters.items() if n != "self"}
        self.save_hyperparameters({**defaults, **kwargs})
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import MixtralConfig, MixtralForCausalLM

            h = {**self.hparams}
            h.pop("learning_rate", None)
            self.model = MixtralForCausalLM(MixtralConfig(**h, attn_implementation="sdpa"))


class DeferredLitGPT(LitGPTModule):
    """litgpt's GPT built in ``configure_model`` (``style``: a key of ``LITGPT_CONFIGS``), initialized with its own
    ``_init_weights``."""

    def __init__(self, n_layer: int = 4, learning_rate: float = 1e-4, style: str = "litgpt_llama", **_: Any) -> None:
        L.LightningModule.__init__(self)
        self.n_layer, self.learning_rate, self.style = n_layer, learning_rate, style
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            from litgpt import GPT as LitGPT
            from litgpt import Config

            config = Config(block_size=16, vocab_size=128, padded_vocab_size=128, n_layer=self.n_layer, n_head=4,
                            n_embd=32, bias=False, **LITGPT_CONFIGS[self.style])  # fmt: skip
            self.model = LitGPT(config)
            self.model.apply(self.model._init_weights)


class _Mixer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        nn.init.trunc_normal_(self.up.weight, std=0.02)  # samples rejected by value: cannot run on meta
        nn.init.orthogonal_(self.down.weight)  # a QR decomposition: cannot run on meta either
        self.gate = nn.Parameter(torch.randn(dim) * 0.1 + 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.gate


class _MixerNet(nn.Module):
    def __init__(self, vocab_size: int, dim: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_Mixer(dim) for _ in range(n_layer))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _NextToken(L.LightningModule):
    """The step every module below shares: next-token cross-entropy on the network's logits, AdamW."""

    net: nn.Module | None

    def forward(self, idx: Tensor) -> Tensor:
        assert self.net is not None
        return self.net(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class UnseenDeferred(_NextToken):
    """A token mixer written for none of the above, built in ``configure_model``."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, n_layer: int = 4, learning_rate: float = 1e-4,
                 **_: Any) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            h = self.hparams
            self.net = _MixerNet(h.vocab_size, h.dim, h.n_layer)


class _TableBlock(nn.Module):
    """Pre-norm attention and MLP, written here (heads found from the width: tensor parallel keeps whole heads)."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm_a, self.norm_m = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.query, self.key, self.value = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.mix = nn.Linear(dim, dim, bias=False)
        self.widen, self.narrow = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.norm_a(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.mix(attended)
        return x + self.narrow(F.gelu(self.widen(self.norm_m(x))))


class _TableNet(nn.Module):
    """Token embedding plus a learned position table that is a bare ``nn.Parameter`` of the network itself, the
    blocks, a final norm, and a head that shares the embedding's weight (``tie``)."""

    def __init__(self, vocab_size: int, dim: int, n_layer: int, block_size: int, tie: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.position_table = nn.Parameter(torch.randn(block_size, dim) * 0.02)
        self.stack = nn.ModuleList(_TableBlock(dim, head_dim=8) for _ in range(n_layer))
        self.final_norm = nn.LayerNorm(dim)
        self.unembed = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.unembed.weight = self.tokens.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tokens(idx) + self.position_table[: idx.shape[1]]
        for block in self.stack:
            x = block(x)
        return self.unembed(self.final_norm(x))


class PositionTableModule(_NextToken):
    """A network never seen by the package with parameters outside its block list: a learned position table on the
    network's root and (``tie``) a head tied to the token embedding. ``build``: ``"configure_model"`` (deferred
    there) or ``"init"`` (in ``__init__``: deferred when made under ``trainer.init_module()``)."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, n_layer: int = 4, block_size: int = 16, tie: bool = True,
                 build: str = "configure_model", learning_rate: float = 1e-4, **_: Any) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(2, block_size, dtype=torch.long)  # the tensor-parallel plan's forward
        self.net = None if build == "configure_model" else self._make()

    def _make(self) -> nn.Module:
        h = self.hparams
        return _TableNet(h.vocab_size, h.dim, h.n_layer, h.block_size, h.tie)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._make()


class TiedCausalLM(_NextToken):
    """A Hugging Face causal LM of ``family`` (``"llama"``, ``"gemma"``, ...) with ``tie_word_embeddings=True``, from a
    config (no download), built in ``configure_model`` or (``build="init"``) in ``__init__``."""

    def __init__(self, family: str = "llama", build: str = "configure_model", learning_rate: float = 1e-4,
                 **config: Any) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.family, self.overrides = family, config
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)
        self.model: nn.Module | None = None if build == "configure_model" else self._make()

    def _make(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        sizes = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}  # fmt: skip
        config = AutoConfig.for_model(self.family, **{**sizes, **self.overrides},
                                      tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
        return AutoModelForCausalLM.from_config(config)

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None
        return self.model(input_ids=idx).logits

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._make()


DEFERRED_MODULES = {
    "deferred_nanogpt": DeferredNanoGPT,
    "deferred_llama": DeferredHFLlama,
    "deferred_mixtral": DeferredHFMixtral,
    "deferred_litgpt": DeferredLitGPT,
    "deferred_unseen": UnseenDeferred,
    "position_table": PositionTableModule,
    "tied_hf": TiedCausalLM,
}


def build_deferred_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    cls = DEFERRED_MODULES.get(model)
    return None if cls is None else cls(**kwargs)
