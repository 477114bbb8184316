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
    only divide it between the embedding, the blocks, the experts and the head).

    Mixture of experts: ``experts`` routed experts per MoE layer (0: a dense model), each token sent to ``top_k`` of
    them, each expert an MLP of ``expert_ffn`` (the family's MLP: SwiGLU for ``"llama"``); ``shared_experts`` MLPs of
    ``shared_ffn`` every token goes through (DeepSeek's shared experts, Qwen2-MoE's shared expert, whose sigmoid gate
    is ``shared_gate``); a router of ``experts x hidden`` per MoE layer. ``dense_layers``: the layers with a dense MLP
    of ``ffn`` instead, the first k (DeepSeek's ``first_k_dense_replace``) or a tuple of layer indices (Qwen's
    ``mlp_only_layers`` / ``decoder_sparse_step``). Parameters split into dense (attention, norms, routers, shared
    experts, embedding, head: every rank of a data-parallel group holds them) and expert (the routed experts' packed
    weights, which expert parallel splits); :attr:`active_params` is what one token uses (FLOPs).
    ``attention_params`` overrides one block's attention count where it is not ``4 h^2``-like (a ``head_dim`` other
    than ``hidden / heads``, DeepSeek's latent attention).

    Example:
        >>> spec = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=2048, family="llama")
        >>> round(spec.total_params / 1e9, 2)
        6.74
        >>> mixtral = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, family="llama", experts=8,
        ...                     top_k=2)
        >>> [round(x / 1e9, 1) for x in (mixtral.total_params, mixtral.expert_params, mixtral.active_params)]
        [46.7, 45.1, 12.9]
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
    experts: int = 0
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    top_k: int = 0
    """Experts each token is routed to (required with ``experts``)."""
    expert_ffn: Optional[int] = None
    """One routed expert's MLP size (HF ``moe_intermediate_size``; default ``ffn``)."""
    shared_experts: int = 0
    """Shared experts per MoE layer, every token through each (DeepSeek ``n_shared_experts``)."""
    shared_ffn: Optional[int] = None
    """One shared expert's MLP size (Qwen2-MoE ``shared_expert_intermediate_size``; default ``expert_ffn``)."""
    shared_gate: bool = False
    """A ``hidden -> 1`` gate on the shared expert's output (Qwen2-MoE)."""
    dense_layers: Union[int, tuple[int, ...]] = 0
    """With experts: the first k layers are dense (an int), or the dense layers' indices (a tuple)."""
    attention_params: Optional[int] = None
    """One block's attention parameters, when not derived from ``hidden``, ``heads`` and ``kv_heads``."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise HybridConfigError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.hidden % self.heads:
            raise HybridConfigError(f"`hidden={self.hidden}` must be a multiple of `heads={self.heads}`.")
        if not isinstance(self.experts, int) or self.experts < 0:
            raise HybridConfigError(f"`experts` must be a non-negative integer, got {self.experts!r}.")
        if self.experts and not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.experts):
            raise HybridConfigError(
                f"`experts={self.experts}` needs `top_k`, the experts each token is routed to (1 to {self.experts}),"
                f" got {self.top_k!r}."
            )
        if self.experts and not self.moe_layer_indices:
            raise HybridConfigError(f"`dense_layers={self.dense_layers!r}` leaves no mixture-of-experts layer.")

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
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_ffn if self.expert_ffn is not None else self.ffn_size

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.experts:
            return ()
        if isinstance(self.dense_layers, int):
            return tuple(range(self.dense_layers, self.layers))
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.layers) if i not in dense)

    def block_params(self, index: int) -> tuple[float, float]:
        """(dense, expert) parameters of block ``index`` (scaled to ``params`` if given).

        Example:
            >>> ModelSpec(layers=2, hidden=8, heads=2, ffn=16, family="llama", experts=4, top_k=2).block_params(0)
            (304.0, 1536.0)
        """
        if index in self._moe_set:
            return self._moe_block_dense * self._scale, self._experts_per_layer * self._scale
        return self._dense_block * self._scale, 0.0

    def stage_params(self, start: int, stop: int) -> tuple[float, float]:
        """(dense, expert) parameters of blocks ``start`` to ``stop - 1``."""
        moe = sum(1 for i in self.moe_layer_indices if start <= i < stop)
        dense_blocks = max(0, min(stop, self.layers) - start) - moe
        return (
            (dense_blocks * self._dense_block + moe * self._moe_block_dense) * self._scale,
            moe * self._experts_per_layer * self._scale,
        )

    @property
    def layer_params(self) -> float:
        """Parameters of one block, on average over the blocks (from the sizes, scaled to ``params`` if given)."""
        dense, expert = self.stage_params(0, self.layers)
        return (dense + expert) / self.layers

    @property
    def expert_params(self) -> float:
        """Parameters of every routed expert of every MoE layer (what expert parallel splits)."""
        return len(self.moe_layer_indices) * self._experts_per_layer * self._scale

    @property
    def dense_params(self) -> float:
        return self.total_params - self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token goes through: the dense ones and ``top_k`` of each MoE layer's experts."""
        if not self.experts:
            return self.total_params
        return self.dense_params + self.expert_params * self.top_k / self.experts

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
    def _mlp_matrices(self) -> int:
        return 3 if self.family == "llama" else 2

    @property
    def _attention_and_norms(self) -> int:
        h, kvd = self.hidden, self.kv * self.head_dim
        attn = self.attention_params if self.attention_params is not None else h * (h + 2 * kvd) + h * h
        biases = (h + 2 * kvd + h) if self.bias and self.attention_params is None else 0
        return attn + biases + 2 * self._norm_params

    @property
    def _dense_block(self) -> int:
        f, h = self.ffn_size, self.hidden
        return self._attention_and_norms + self._mlp_matrices * h * f + ((f + h) if self.bias else 0)

    @property
    def _moe_block_dense(self) -> int:
        """A MoE block's dense parameters: attention, norms, the router, the shared experts and their gate."""
        h = self.hidden
        s = self.shared_ffn if self.shared_ffn is not None else self.expert_ffn_size
        shared = self.shared_experts * (self._mlp_matrices * h * s + ((s + h) if self.bias else 0))
        return self._attention_and_norms + self.experts * h + shared + (h if self.shared_gate else 0)

    @property
    def _experts_per_layer(self) -> int:
        h, f, k = self.hidden, self.expert_ffn_size, self._mlp_matrices
        return self.experts * (k * h * f + (((k - 1) * f + h) if self.bias else 0))

    @property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layer_indices)

    @property
    def _derived_total(self) -> int:
        head = (0 if self.tied else self.vocab * self.hidden) + self._norm_params
        embedding = (self.vocab + self.position_embeddings) * self.hidden
        moe = len(self.moe_layer_indices)
        blocks = (self.layers - moe) * self._dense_block + moe * (self._moe_block_dense + self._experts_per_layer)
        return blocks + embedding + head

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

        Mixture-of-experts sizes are read under the names of Mixtral (``num_local_experts``,
        ``num_experts_per_tok``, ``intermediate_size`` for each expert), Qwen2/3-MoE (``num_experts``,
        ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``)
        and DeepSeek-V3 (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``, and its latent
        attention's ranks):

            >>> moe = ModelSpec.from_hf_config({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
            ...     "num_attention_heads": 4, "intermediate_size": 128, "num_local_experts": 8,
            ...     "num_experts_per_tok": 2})
            >>> moe.experts, moe.top_k, moe.expert_ffn, moe.moe_layer_indices
            (8, 2, 128, (0, 1))
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
        ffn = get("intermediate_size", "n_inner", "ffn_dim", default=None)
        return cls(
            layers=int(layers),
            hidden=int(hidden),
            heads=int(heads),
            kv_heads=get("num_key_value_heads", "n_kv_heads", default=None),
            ffn=ffn,
            vocab=int(get("vocab_size", default=32000)),
            seq=int(seq or get("max_position_embeddings", "n_positions", default=2048)),
            family="gpt" if gpt else "llama",
            bias=bool(get("attention_bias", default=gpt)),
            tied=bool(get("tie_word_embeddings", default=False)),
            position_embeddings=int(get("n_positions", default=0)) if model_type == "gpt2" else 0,
            attention_params=_hf_attention_params(get, model_type, int(hidden), int(heads)),
            **_hf_moe_sizes(get, model_type, int(layers), ffn),
        )

    @classmethod
    def from_module(cls, module: nn.Module, seq: Optional[int] = None) -> ModelSpec:
        """Read the sizes off a built module (on any device, the meta device included): the block list, the token
        embedding and the head as :func:`~lightning_hybrid.structure.find_model_structure` finds them, the attention
        heads from the attribute that counts them, and the exact parameter count.

        Mixture-of-experts layers are the experts modules expert parallel finds
        (:func:`~lightning_hybrid.expert_parallel.find_expert_modules`: packed weights whose first dimension is the
        expert): their count, each expert's MLP size from the packed shapes, ``top_k`` from the attribute that holds
        it, the shared experts (modules named ``shared_expert*``), the dense blocks, and one block's attention
        parameters counted exactly (so the dense / expert split is the module's own).

        Example:
            >>> import torch
            >>> from examples.nanogpt import NanoGPT
            >>> with torch.device("meta"):
            ...     spec = ModelSpec.from_module(NanoGPT(n_layer=2, n_embd=32))
            >>> spec.layers, spec.hidden, spec.is_moe
            (2, 32, False)
        """
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
        moe = _module_moe_sizes(module, structure.block_names(), hidden, 3 if family == "llama" else 2)
        if moe.get("dense_layers") == () or "dense_ffn" in moe:
            ffn = moe.pop("dense_ffn", None) or moe["expert_ffn"]  # the MLP of the dense blocks, if any
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
            **moe,
        )

    def with_seq(self, seq: int) -> ModelSpec:
        return replace(self, seq=seq)


def _module_moe_sizes(module: nn.Module, block_names: list[str], hidden: int, matrices: int) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelSpec` read off a built module (empty for a dense one), plus
    ``dense_ffn``, the dense blocks' MLP size, when some blocks are dense."""
    from lightning_hybrid.expert_parallel.discover import find_expert_modules

    found, _ = find_expert_modules(module)
    if not found:
        return {}
    owner = {i: e for i, b in enumerate(block_names) for e in found if e.name.startswith(b + ".")}
    if not owner:
        return {}
    first = min(owner)
    experts = module.get_submodule(owner[first].name)
    count = owner[first].num_experts
    packed = sum(p.numel() for p in experts.parameters(recurse=False) if p.dim() >= 3)
    block = module.get_submodule(block_names[first])
    top_k = None
    for m in block.modules():
        for attr in ("top_k", "num_experts_per_tok", "moe_k"):
            value = getattr(m, attr, None)
            top_k = top_k or (value if isinstance(value, int) else None)
        config = getattr(m, "config", None)
        top_k = top_k or getattr(config, "num_experts_per_tok", None)
    out: dict[str, Any] = {
        "experts": count,
        "top_k": int(top_k or 1),
        "expert_ffn": packed // (count * matrices * hidden),
        "dense_layers": tuple(i for i in range(len(block_names)) if i not in owner),
    }
    shared = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear) and "shared_expert" in n]
    shared_numel = sum(m.weight.numel() for _, m in shared if m.out_features != 1)
    if shared_numel:
        out.update(shared_experts=1, shared_ffn=shared_numel // (matrices * hidden),
                   shared_gate=any(m.out_features == 1 for _, m in shared))  # fmt: skip
    attention = next((m for m in block.modules() if "attention" in type(m).__name__.lower()), None)
    if attention is not None:
        out["attention_params"] = sum(p.numel() for p in attention.parameters())
    if out["dense_layers"]:
        dense = module.get_submodule(block_names[out["dense_layers"][0]])
        linears = [m for m in dense.modules() if isinstance(m, nn.Linear) and m.in_features == hidden]
        out["dense_ffn"] = max((m.out_features for m in linears), default=None)
    return out


def _hf_attention_params(get: Any, model_type: str, hidden: int, heads: int) -> Optional[int]:
    """One block's attention parameters where a Hugging Face config's attention is not ``h x (h + 2 kv d) + h^2``:
    DeepSeek's multi-head latent attention (``kv_lora_rank``), a ``head_dim`` other than ``hidden / heads``, Qwen3's
    per-head q/k norms, Qwen2's q/k/v biases. None otherwise."""
    kv_lora = get("kv_lora_rank")
    if kv_lora:
        nope, rope = int(get("qk_nope_head_dim", default=128)), int(get("qk_rope_head_dim", default=64))
        v, q_lora = int(get("v_head_dim", default=nope)), get("q_lora_rank")
        q_dim = heads * (nope + rope)
        q = hidden * q_dim if not q_lora else hidden * q_lora + q_lora + q_lora * q_dim
        kv = hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)
        return q + kv + heads * v * hidden
    head_dim = get("head_dim")
    qk_norms = model_type.startswith("qwen3")
    # Qwen2's q/k/v projections have biases (always for Qwen2, `qkv_bias` for Qwen2-MoE), its output projection none
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and get("qkv_bias", default=True))
    if (head_dim is None or head_dim * heads == hidden) and not qk_norms and not qkv_bias:
        return None
    kv = int(get("num_key_value_heads", default=heads))
    d = int(head_dim or hidden // heads)
    biases = heads * d + 2 * kv * d if qkv_bias else 0
    return 2 * hidden * heads * d + 2 * hidden * kv * d + (2 * d if qk_norms else 0) + biases


def _hf_moe_sizes(get: Any, model_type: str, layers: int, ffn: Optional[int]) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelSpec` from a Hugging Face config (empty for a dense one)."""
    experts = get("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if not experts:
        return {}
    out: dict[str, Any] = {
        "experts": int(experts),
        "top_k": int(get("num_experts_per_tok", "moe_k", "moe_topk", default=1)),
        "expert_ffn": get("moe_intermediate_size", default=ffn),
    }
    if get("n_shared_experts"):  # DeepSeek: one MLP of n_shared_experts x moe_intermediate_size
        out["shared_experts"] = int(get("n_shared_experts"))
    elif get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own size, and its gate
        out.update(shared_experts=1, shared_ffn=int(get("shared_expert_intermediate_size")),
                   shared_gate=model_type == "qwen2_moe")  # fmt: skip
    step, only = int(get("decoder_sparse_step", default=1) or 1), set(get("mlp_only_layers", default=()) or ())
    if get("first_k_dense_replace"):
        out["dense_layers"] = int(get("first_k_dense_replace"))
    elif step > 1 or only:  # Qwen: layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
        out["dense_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return out


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
