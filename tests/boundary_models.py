"""Networks written for the pipeline's stage boundaries (tests/test_pipeline_boundaries.py), tiny and in plain torch,
none of them a transformer stack of one hidden-state shape and dtype:

- ``boundary_mlp``: flattened images through a list of linear layers; the first takes the images as they come
  (fp32 under autocast), every layer returns autocast's dtype (bf16/fp16);
- ``boundary_graph``: a message-passing network on each image's 8 x 8 pixel grid (64 nodes, 4-neighbour edges): each
  layer sums its neighbours' features with ``index_add_`` along fixed edge lists;
- ``boundary_unet`` (``pattern``): U-Net levels; a down level (``D``) returns ``(half-resolution features, skip)``,
  an up level (``U``) takes the features and the skip its forward pops from a list. ``"DUDUDUDU"`` keeps every skip
  inside a pair of neighbouring levels (inside one stage of any cut between pairs); ``"DDUU"`` runs a skip from the
  first level to the last, across any cut;
- ``boundary_hybrid``: a language model whose decoder layers return ``(hidden, attention weights)``, as transformers'
  hybrid state-space/attention families do: gated causal convolution layers return ``None`` weights, attention
  layers their softmax;
- ``boundary_pyramid``: a hierarchical vision network whose stages take the tokens and their grid size and return
  ``(merged tokens, (height, width))``, the size read by the forward for the next stage.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.any_module_models import IMAGE_SHAPE, NUM_CLASSES, _Classifier

CHANNELS, SIDE = IMAGE_SHAPE[0], IMAGE_SHAPE[1]


# ------------------------------------------------------------------------------------------------------------ MLP
class _Layer(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(self.fc(x))


class MLPNet(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 4) -> None:
        super().__init__()
        width = CHANNELS * SIDE * SIDE
        self.layers = nn.ModuleList([_Layer(width, hidden)] + [_Layer(hidden, hidden) for _ in range(depth - 1)])
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        h = images.flatten(1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# ---------------------------------------------------------------------------------------------------------- graph
def _grid_edges(side: int) -> tuple[Tensor, Tensor]:
    """Both directions of every 4-neighbour edge of a ``side`` x ``side`` grid, as (source, target) node lists."""
    src, dst = [], []
    for r in range(side):
        for c in range(side):
            for dr, dc in ((0, 1), (1, 0)):
                if r + dr < side and c + dc < side:
                    a, b = r * side + c, (r + dr) * side + c + dc
                    src += [a, b]
                    dst += [b, a]
    return torch.tensor(src), torch.tensor(dst)


class MessagePassing(nn.Module):
    """A node's new features from its own and the mean of its neighbours' (GraphSAGE-style)."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.own = nn.Linear(width_in, width_out)
        self.neighbours = nn.Linear(width_in, width_out, bias=False)

    def forward(self, h: Tensor, src: Tensor, dst: Tensor, degree: Tensor) -> Tensor:
        summed = h.new_zeros(h.shape).index_add_(1, dst, h[:, src])
        return F.silu(self.own(h) + self.neighbours(summed / degree[:, None]))


class GraphNet(nn.Module):
    def __init__(self, hidden: int = 16, depth: int = 4) -> None:
        super().__init__()
        src, dst = _grid_edges(SIDE)
        self.register_buffer("src", src, persistent=False)
        self.register_buffer("dst", dst, persistent=False)
        self.register_buffer("degree", torch.bincount(dst, minlength=SIDE * SIDE).float(), persistent=False)
        self.layers = nn.ModuleList(MessagePassing(CHANNELS if i == 0 else hidden, hidden) for i in range(depth))
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        h = images.flatten(2).transpose(1, 2)  # (batch, nodes, features): one node per pixel
        for layer in self.layers:
            h = layer(h, self.src, self.dst, self.degree)
        return self.head(h.mean(1))


# ----------------------------------------------------------------------------------------------------------- U-Net
class Level(nn.Module):
    """A U-Net level: ``down`` convolves, then halves the resolution, and hands on the full-resolution features as the
    skip; an up level doubles the resolution and adds the skip it is given before convolving."""

    def __init__(self, width_in: int, width_out: int, down: bool) -> None:
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(width_in, width_out, 3, padding=1)

    def forward(self, h: Tensor, skip: Optional[Tensor] = None) -> Any:
        if self.down:
            features = F.silu(self.conv(h))
            return F.avg_pool2d(features, 2), features
        return F.silu(self.conv(F.interpolate(h, scale_factor=2.0, mode="nearest") + skip))


class UNetNet(nn.Module):
    def __init__(self, pattern: str = "DUDUDUDU", width: int = 8) -> None:
        super().__init__()
        self.levels = nn.ModuleList(
            Level(CHANNELS if i == 0 else width, width, kind == "D") for i, kind in enumerate(pattern)
        )
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        h, skips = images, []
        for level in self.levels:
            if level.down:
                h, skip = level(h)
                skips.append(skip)
            else:
                h = level(h, skips.pop())
        return self.head(h.mean((2, 3)))


# ------------------------------------------------------------------------------- pyramid (stages return their size)
class PyramidStage(nn.Module):
    """A token MLP, then (``merge``) each 2 x 2 neighbourhood of tokens merged into one of twice the width; takes and
    returns the token grid's size, which the stage cannot tell from the tokens alone."""

    def __init__(self, width: int, merge: bool) -> None:
        super().__init__()
        self.merge = merge
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.reduce = nn.Linear(4 * width, 2 * width) if merge else None

    def forward(self, h: Tensor, size: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
        height, width = size
        h = h + self.mlp(self.norm(h))
        if self.reduce is not None:
            b, _, c = h.shape
            h = h.view(b, height // 2, 2, width // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, 4 * c)
            h, height, width = self.reduce(h), height // 2, width // 2
        return h, (height, width)


class PyramidNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.patches = nn.Conv2d(CHANNELS, width, 1)
        widths, merges = [width, 2 * width, 4 * width, 4 * width], [True, True, False, False]
        self.stages = nn.ModuleList(PyramidStage(w, m) for w, m in zip(widths, merges))
        self.head = nn.Linear(4 * width, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        h = self.patches(images).flatten(2).transpose(1, 2)
        size = (images.shape[2], images.shape[3])
        for stage in self.stages:
            h, size = stage(h, size)
        return self.head(h.mean(1))


# ----------------------------------------------------------------------- hybrid convolution/attention language model
class GatedConvolution(nn.Module):
    """A state-space-style token mixer: a causal depthwise convolution gated by the input (no attention weights)."""

    def __init__(self, width: int, kernel: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * width, bias=False)
        self.conv = nn.Conv1d(width, width, kernel, groups=width, padding=kernel - 1)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        value, gate = self.in_proj(x).chunk(2, dim=-1)
        mixed = self.conv(value.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out_proj(mixed * F.silu(gate)), None


class CausalAttention(nn.Module):
    """Eager causal self-attention that returns its softmax weights, as transformers' eager attention does."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, d)), weights


class HybridLayer(nn.Module):
    def __init__(self, width: int, attention: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mixer = CausalAttention(width) if attention else GatedConvolution(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        mixed, weights = self.mixer(self.norm1(hidden_states))
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.norm2(hidden_states)), weights


class HybridLM(nn.Module):
    def __init__(self, vocab_size: int = 128, width: int = 32, layers: str = "CACA") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(HybridLayer(width, kind == "A") for kind in layers)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, output_attentions: bool = False) -> Tensor:
        hidden_states = self.embed(input_ids)
        attentions = []
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states)
            if output_attentions:
                attentions.append(weights)
        return self.head(self.norm(hidden_states))


class _HybridLanguageModel(L.LightningModule):
    def __init__(self, learning_rate: float = 1e-4, **kwargs: Any) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.model = HybridLM(**kwargs)
        self.example_input_array = torch.zeros(2, 16, dtype=torch.long)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class _NetClassifier(_Classifier):
    def __init__(self, net: nn.Module, learning_rate: float = 1e-4) -> None:
        super().__init__(learning_rate=learning_rate)
        self.net = net
        self.example_input_array = torch.zeros(2, *IMAGE_SHAPE)


def build_boundary_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    """``boundary_mlp``, ``boundary_graph``, ``boundary_unet`` (``pattern``), ``boundary_pyramid`` or
    ``boundary_hybrid``; None for other names."""
    nets = {"boundary_mlp": MLPNet, "boundary_graph": GraphNet, "boundary_unet": UNetNet,
            "boundary_pyramid": PyramidNet}  # fmt: skip
    if model == "boundary_hybrid":
        return _HybridLanguageModel(**kwargs)
    if model not in nets:
        return None
    learning_rate = kwargs.pop("learning_rate", 1e-4)
    return _NetClassifier(nets[model](**kwargs), learning_rate=learning_rate)
