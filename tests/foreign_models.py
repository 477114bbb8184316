"""LightningModules written without this project in mind, for the "any module" scenarios:

* ``litgpt_llama`` and ``litgpt_pythia``: litgpt's ``GPT`` (Lightning's own LLM library) built from a tiny config,
  without weights, inside a plain single-device LightningModule. Its ``lm_head`` is registered *before* the block
  list ``transformer.h`` and called after it.
* ``lightning_mp``: a module written exactly as Lightning's ``ModelParallelStrategy`` docs show: its
  ``configure_model`` applies ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on
  ``self.device_mesh["tensor_parallel"]`` and ``fully_shard`` on ``self.device_mesh["data_parallel"]``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

LITGPT_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-style: RMSNorm, SwiGLU MLP, grouped-query attention, full rotary, sequential residual
    "litgpt_llama": {"norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 64,
                     "n_query_groups": 2, "rotary_percentage": 1.0, "parallel_residual": False},
    # Pythia-style (GPT-NeoX): LayerNorm, GELU MLP, partial rotary, parallel residual
    "litgpt_pythia": {"norm_class_name": "LayerNorm", "mlp_class_name": "GptNeoxMLP", "intermediate_size": 128,
                      "n_query_groups": 4, "rotary_percentage": 0.25, "parallel_residual": True},
}  # fmt: skip


class LitGPTModule(L.LightningModule):
    """``litgpt.GPT(Config(...))`` with a next-token loss; no parallel code. Biases off: a key bias's gradient is
    rounding noise that Adam amplifies (docs/testing.md)."""

    def __init__(self, style: str, n_layer: int = 4, learning_rate: float = 1e-4, **_: Any) -> None:
        super().__init__()
        from litgpt import GPT, Config

        config = Config(
            block_size=16, vocab_size=128, padded_vocab_size=128, n_layer=n_layer, n_head=4, n_embd=32, bias=False,
            **LITGPT_CONFIGS[style],
        )  # fmt: skip
        self.model = GPT(config)
        self.model.apply(self.model._init_weights)
        self.learning_rate = learning_rate

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, bias=False)
        self.feed_forward = _FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.feed_forward(self.norm(x))


class _Net(nn.Module):
    def __init__(self, vocab_size: int, dim: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_Block(dim, hidden) for _ in range(n_layer))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LightningModelParallelModule(L.LightningModule):
    """The LightningModule of Lightning's ``ModelParallelStrategy`` guide (2D parallel: tensor parallel of each
    feed-forward, then FSDP2 of each block and of the model over the data-parallel dimension)."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, hidden: int = 64, n_layer: int = 2,
                 learning_rate: float = 1e-4, **_: Any) -> None:  # fmt: skip
        super().__init__()
        self.learning_rate = learning_rate
        self.model = _Net(vocab_size, dim, hidden, n_layer)

    def configure_model(self) -> None:
        # as in Lightning's guide: the mesh has the dimensions "data_parallel" and "tensor_parallel"
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
            for layer in self.model.layers:
                parallelize_module(layer.feed_forward, tp_mesh, plan)
        if dp_mesh.size() > 1:
            for layer in self.model.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class _SingleDevice(LightningModelParallelModule):
    """The same module on one device, the reference: Lightning's guide runs ``configure_model`` under
    ``ModelParallelStrategy`` only (a single-device Trainer has no ``device_mesh``)."""

    def configure_model(self) -> None:
        pass


def build_foreign_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """The modules above by name (``lightning_mp_single``: the reference of ``lightning_mp``); None for others."""
    if model in LITGPT_CONFIGS:
        return LitGPTModule(model, **kwargs)
    if model == "lightning_mp":
        return LightningModelParallelModule(**kwargs)
    if model == "lightning_mp_single":
        return _SingleDevice(**kwargs)
    return None
