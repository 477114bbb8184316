"""What the planner needs to know of a model, from raw sizes, a Hugging Face config, or the module itself."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Optional, Union

from torch import nn

from lightning_hybrid.config import HybridConfigError

__all__ = ["ModelSpec", "build_on_meta"]

Family = Literal["gpt", "llama"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer by its sizes.

    ``family`` picks the block's layout for the activation count: ``"gpt"`` (LayerNorm, fused q|k|v, GELU MLP of
    ``ffn``) or ``"llama"`` (RMSNorm, separate q/k/v with rotary embeddings, SwiGLU MLP of ``ffn``).
    ``params`` is the total parameter count; when given it overrides the count derived from the sizes (which then
    only divide it between the embedding, the blocks and the head).

    Example:
        >>> spec = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=2048, family="llama")
        >>> round(spec.total_params / 1e9, 2)
        6.74
    """

    layers: int
    hidden: int
    heads: int
    ffn: Optional[int] = None
    vocab: int = 32000
    seq: int = 2048
    kv_heads: Optional[int] = None
    params: Optional[float] = None
    family: Family = "gpt"
    bias: bool = False
    tied: bool = False
    position_embeddings: int = 0
    """Rows of a learned position table (GPT-2 style), 0 for rotary/none."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise HybridConfigError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.hidden % self.heads:
            raise HybridConfigError(f"`hidden={self.hidden}` must be a multiple of `heads={self.heads}`.")

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    # ------------------------------------------------------------------ parameter counts
    @property
    def layer_params(self) -> float:
        """Parameters of one block (from the sizes, scaled to ``params`` if given)."""
        return self._layer_params_from_sizes * self._scale

    @property
    def embedding_params(self) -> float:
        return (self.vocab + self.position_embeddings) * self.hidden * self._scale

    @property
    def head_params(self) -> float:
        """The output head, and the final norm (0 for the head when tied: the embedding holds it)."""
        return ((0 if self.tied else self.vocab * self.hidden) + self._norm_params) * self._scale

    @property
    def total_params(self) -> float:
        return self.params if self.params is not None else self._derived_total

    @property
    def _norm_params(self) -> int:
        return self.hidden * (2 if self.family == "gpt" and self.bias else 1)

    @property
    def _layer_params_from_sizes(self) -> int:
        h, f, kvd = self.hidden, self.ffn_size, self.kv * self.head_dim
        attn = h * (h + 2 * kvd) + h * h
        mlp = (3 if self.family == "llama" else 2) * h * f
        norms = 2 * self._norm_params
        biases = (h + 2 * kvd + h + f + h) if self.bias else 0
        return attn + mlp + norms + biases

    @property
    def _derived_total(self) -> int:
        head = (0 if self.tied else self.vocab * self.hidden) + self._norm_params
        embedding = (self.vocab + self.position_embeddings) * self.hidden
        return self.layers * self._layer_params_from_sizes + embedding + head

    @property
    def _scale(self) -> float:
        return 1.0 if self.params is None else self.params / self._derived_total

    # ------------------------------------------------------------------ other forms
    @classmethod
    def from_hf_config(cls, config: Union[dict[str, Any], str, Path], seq: Optional[int] = None) -> ModelSpec:
        """From a Hugging Face config: a dict, a ``config.json`` file, or a local model folder holding one.

        Example:
            >>> spec = ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            ...     "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 128})
            >>> spec.family, spec.layers
            ('llama', 2)
        """
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise HybridConfigError(f"`hf_config={str(config)!r}`: no such file or folder with a config.json.")
            config = json.loads(path.read_text())
        c = config

        def get(*names: str, default: Any = None) -> Any:
            for n in names:
                if c.get(n) is not None:
                    return c[n]
            return default

        model_type = str(get("model_type", default="llama"))
        gpt = model_type in ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon")
        hidden = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head")
        if None in (hidden, layers, heads):
            raise HybridConfigError(
                "The Hugging Face config needs hidden_size, num_hidden_layers and num_attention_heads (or their GPT-2"
                f" names n_embd, n_layer, n_head); got keys {sorted(c)[:12]}..."
            )
        return cls(
            layers=int(layers),
            hidden=int(hidden),
            heads=int(heads),
            kv_heads=get("num_key_value_heads", "n_kv_heads", default=None),
            ffn=get("intermediate_size", "n_inner", "ffn_dim", default=None),
            vocab=int(get("vocab_size", default=32000)),
            seq=int(seq or get("max_position_embeddings", "n_positions", default=2048)),
            family="gpt" if gpt else "llama",
            bias=bool(get("attention_bias", default=gpt)),
            tied=bool(get("tie_word_embeddings", default=False)),
            position_embeddings=int(get("n_positions", default=0)) if model_type == "gpt2" else 0,
        )

    @classmethod
    def from_module(cls, module: nn.Module, seq: Optional[int] = None) -> ModelSpec:
        """Read the sizes off a built module (on any device, the meta device included): the block list, the token
        embedding and the head as :func:`~lightning_hybrid.structure.find_model_structure` finds them, the attention
        heads from the attribute that counts them, and the exact parameter count."""
        from lightning_hybrid.structure import find_model_structure
        from lightning_hybrid.tensor_parallel.plan import HEAD_COUNT_ATTRIBUTES

        structure = find_model_structure(module)
        if structure.blocks_name is None or structure.token_embedding_name is None:
            raise HybridConfigError(
                f"{type(module).__name__} has no transformer block list or token embedding the planner can read: give"
                " the sizes instead (layers, hidden, heads, ffn, vocab, seq)."
            )
        block = module.get_submodule(structure.blocks_name)[0]
        embedding = module.get_submodule(structure.token_embedding_name)
        hidden, vocab = embedding.embedding_dim, embedding.num_embeddings
        heads = kv = None
        for m in block.modules():
            for attr in HEAD_COUNT_ATTRIBUTES:
                value = getattr(m, attr, None)
                if isinstance(value, int):
                    if "kv" in attr or "key_value" in attr:
                        kv = kv or value
                    else:
                        heads = heads or value
            config = getattr(m, "config", None)
            if heads is None and config is not None and hasattr(config, "num_attention_heads"):
                heads = config.num_attention_heads
                kv = getattr(config, "num_key_value_heads", None)
        if heads is None:
            raise HybridConfigError(f"No attribute of {type(block).__name__} counts its attention heads: give `heads`.")
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        ffn = max(m.out_features for m in linears if m.in_features == hidden and m.out_features != 3 * hidden)
        norms = [type(m).__name__ for m in block.modules() if "norm" in type(m).__name__.lower()]
        family: Family = "llama" if any("RMS" in n for n in norms) else "gpt"
        positions = [
            m.num_embeddings
            for n, m in module.named_modules()
            if isinstance(m, nn.Embedding) and n != structure.token_embedding_name
        ]
        unique = {id(p): p for p in module.parameters()}.values()
        return cls(
            layers=structure.num_blocks,
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            ffn=ffn,
            vocab=vocab,
            seq=seq or (positions[0] if positions else 2048),
            params=float(sum(p.numel() for p in unique)),
            family=family,
            bias=any(m.bias is not None for m in linears),
            tied=bool(structure.tied_parameters),
            position_embeddings=positions[0] if positions else 0,
        )

    def with_seq(self, seq: int) -> ModelSpec:
        return replace(self, seq=seq)


def build_on_meta(class_path: str, init_args: Optional[dict[str, Any]] = None) -> nn.Module:
    """Build ``package.module.Class(**init_args)`` on the meta device: shapes without memory, so a 70B model costs
    nothing.

    Example:
        >>> build_on_meta("torch.nn.Linear", {"in_features": 4, "out_features": 2}).weight.device.type
        'meta'
    """
    import torch

    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        raise HybridConfigError(f"`model={class_path!r}` must be a class path such as 'examples.nanogpt.NanoGPT'.")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise HybridConfigError(f"`model={class_path!r}` cannot be imported: {error}") from None
    with torch.device("meta"):
        return cls(**(init_args or {}))
