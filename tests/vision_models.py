"""Vision networks whose block lists the pipeline once cut wrong (tests/test_pipeline_cuts.py), tiny and in plain torch,
on the synthetic images of tests/any_module_models.py (3 x 8 x 8, 10 classes):

- ``hierarchical_vit``: Swin-like stages of transformer blocks, each ending in a patch merge that halves the
  resolution and doubles the width, so the hidden state changes shape along the block list (64 tokens of 16, then 16
  of 32): the cut sent the shape that enters the first block. ``checked_hierarchical_vit`` checks its input by
  reading values, so its forward cannot run on meta tensors to show the boundaries' shapes;
- ``channels_last_cnn``: ConvNeXt-like blocks on a channels-last view (``permute(0, 2, 3, 1)`` of the stem's
  output), whose outputs are not contiguous: a stage boundary sent a view;
- ``masked_vit``: a ViT whose embeddings hold a ``mask_token`` that the forward uses only when a mask is passed
  (Hugging Face ViT's ``use_mask_token``); the step passes none, so it gets no gradient, on one device as well.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.any_module_models import IMAGE_SHAPE, NUM_CLASSES, _Classifier


class _Attention(nn.Module):
    """Multi-head self-attention over every token (the whole image is one window). No bias on ``qkv``: the key
    bias's gradient is exactly zero, rounding noise that Adam turns into full steps (docs/testing.md)."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), _Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Swin's down-sampling: each 2 x 2 neighbourhood of tokens becomes one token of twice the width."""

    def __init__(self, dim: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, _, d = x.shape
        r = self.resolution
        x = x.view(b, r // 2, 2, r // 2, 2, d).permute(0, 1, 3, 4, 2, 5).reshape(b, (r // 2) ** 2, 4 * d)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, dim: int, resolution: int, depth: int, downsample: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(dim) for _ in range(depth))
        self.downsample = PatchMerging(dim, resolution) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.downsample(x) if self.downsample is not None else x


class HierarchicalViTNet(nn.Module):
    """The block list is ``layers``: two Swin stages, (64 tokens, 16) -> (16 tokens, 32) -> (16 tokens, 32)."""

    def __init__(self, dim: int = 16, depth: int = 1) -> None:
        super().__init__()
        resolution = IMAGE_SHAPE[1]
        self.patch_embed = nn.Conv2d(IMAGE_SHAPE[0], dim, kernel_size=1)
        self.layers = nn.ModuleList(
            [SwinStage(dim, resolution, depth, downsample=True), SwinStage(2 * dim, resolution // 2, depth, False)]
        )
        self.norm = nn.LayerNorm(2 * dim)
        self.head = nn.Linear(2 * dim, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(1))


class CheckedHierarchicalViTNet(HierarchicalViTNet):
    """Checks its input by reading values, which no forward on meta tensors can: the boundaries' shapes are not
    known before the first step."""

    def forward(self, images: Tensor) -> Tensor:
        if not bool(torch.isfinite(images).all()):
            raise ValueError("the images must be finite")
        return super().forward(images)


class ConvNeXtBlock(nn.Module):
    """Channels-last in and out: a depthwise convolution (on a channels-first view), then a per-pixel MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return x + self.pw2(F.gelu(self.pw1(self.norm(y))))


class ChannelsLastCNNNet(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(IMAGE_SHAPE[0], dim, kernel_size=2, stride=2)
        self.blocks = nn.ModuleList(ConvNeXtBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images).permute(0, 2, 3, 1)  # a channels-last view, not a copy
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.mean((1, 2))))


class MaskableEmbeddings(nn.Module):
    """Hugging Face ViT's embeddings with ``use_mask_token``: masked patches are replaced by ``mask_token``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        patches = (IMAGE_SHAPE[1] // 2) ** 2
        self.projection = nn.Conv2d(IMAGE_SHAPE[0], dim, kernel_size=2, stride=2)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.position_embeddings = nn.Parameter(0.02 * torch.randn(1, patches + 1, dim))

    def forward(self, images: Tensor, bool_masked_pos: Optional[Tensor] = None) -> Tensor:
        x = self.projection(images).flatten(2).transpose(1, 2)
        if bool_masked_pos is not None:
            w = bool_masked_pos.unsqueeze(-1).type_as(x)
            x = x * (1 - w) + self.mask_token.expand_as(x) * w
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.position_embeddings


class MaskedViTNet(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embeddings = MaskableEmbeddings(dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, images: Tensor, bool_masked_pos: Optional[Tensor] = None) -> Tensor:
        x = self.embeddings(images, bool_masked_pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


class _VisionClassifier(_Classifier):
    """Cross-entropy on ``self.net(images)`` (no mask), AdamW at the test models' learning rate of 1e-4."""

    def __init__(self, net: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = net


def build_vision_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``hierarchical_vit`` (``checked_``: its forward reads values), ``channels_last_cnn`` or ``masked_vit``; None
    for other names."""
    nets = {"hierarchical_vit": HierarchicalViTNet, "checked_hierarchical_vit": CheckedHierarchicalViTNet,
            "channels_last_cnn": ChannelsLastCNNNet, "masked_vit": MaskedViTNet}  # fmt: skip
    if model not in nets:
        return None
    return _VisionClassifier(nets[model](), **kwargs)
