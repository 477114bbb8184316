"""Modules for the pipeline-ownership scenarios (tests/test_pipeline.py, tests/test_checkpoint.py): parameters that
sit directly on the network instead of inside a module, and a module whose replicas disagree on purpose."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn


def build_pipeline_module(model: str, **kwargs: Any) -> L.LightningModule | None:
    """``posemb_gpt``: the nanoGPT example with GPT/ViT-style bare parameters on the network itself: a learned
    position embedding ``model.pos_emb`` added before the blocks (in place of the ``wpe`` module) and a gain
    ``model.out_gain`` applied after them. ``nanogpt_tied_aux_head``: the nanoGPT example with ``lm_head`` tied to
    ``wte`` and a second, untied vocabulary head ``aux_head`` registered after it, which the automatic
    tensor-parallel plan takes as the output head: the tied head stays whole while the embedding is split.
    ``nanogpt_rank_marker``: the nanoGPT example plus a persistent buffer that holds each rank's global rank, so two
    ranks hold different values under one checkpoint key. Three whose forward does not fit the stage cut:
    ``late_norm_gpt`` registers ``ln_f`` before the block list and calls it after, and gives no
    ``example_input_array`` (which would show the call order); ``positions_again_gpt`` reads the
    position embedding's output again after the blocks (the last stage only has a zero stand-in for it: refused by the
    trace's connections across the cut); ``scaled_between_gpt`` halves the hidden state after each block, in its own
    forward (lost where a stage ends: only ``verify_pipeline``'s comparison sees it). ``wrapped_forward_gpt``: a
    module whose forward wraps its network call, and a network
    whose forward wraps its block loop, in ``try/except Exception`` that re-raises the user's own ``RuntimeError``:
    the strategy's control flow (stopping at a stage boundary or after the call's inputs are captured) must pass
    through both. None for other names."""
    from examples.nanogpt import GPT, NanoGPT

    class RootParameterGPT(GPT):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            del self.wpe
            self.pos_emb = nn.Parameter(torch.randn(config.block_size, config.n_embd) * 0.02)
            self.out_gain = nn.Parameter(1.0 + 0.1 * torch.randn(config.n_embd))

        def forward(self, idx: Tensor) -> Tensor:
            x = self.drop(self.wte(idx) + self.pos_emb[: idx.shape[1]])
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x) * self.out_gain)

    class PosEmbGPT(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = RootParameterGPT(self.model.config)

    class AuxHeadGPT(GPT):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.aux_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        def forward(self, idx: Tensor) -> Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            x = self.ln_f(x)
            return self.lm_head(x) + self.aux_head(x)

    class TiedAuxHead(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**{**kwargs, "tie_weights": True})
            self.model = AuxHeadGPT(self.model.config)

    class RankMarker(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.register_buffer("rank_marker", torch.zeros(1))

        def on_fit_start(self) -> None:
            self.rank_marker.fill_(float(self.global_rank))

    class LateNormGPT(GPT):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            # registered before the block list, called after it
            self._modules = {"ln_f": self._modules.pop("ln_f"), **self._modules}

    class LateNorm(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = LateNormGPT(self.model.config)
            # no example to show the call order: the cut follows registration order, and the first step refuses it
            self.example_input_array = None

    class PositionsAgainGPT(GPT):
        def forward(self, idx: Tensor) -> Tensor:
            pos = self.wpe(torch.arange(idx.shape[1], device=idx.device))
            x = self.drop(self.wte(idx) + pos)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x + pos))  # the input module's output read again after the blocks

    class PositionsAgain(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = PositionsAgainGPT(self.model.config)

    class ScaledBetweenGPT(GPT):
        def forward(self, idx: Tensor) -> Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.h:
                x = block(x) * 0.5  # the forward's own change between two blocks: lost where a stage ends
            return self.lm_head(self.ln_f(x))

    class ScaledBetween(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = ScaledBetweenGPT(self.model.config)

    class WrappingGPT(GPT):
        def forward(self, idx: Tensor) -> Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            try:  # a user's guard around the blocks: whatever fails in them is reported as the user's own error
                for block in self.h:
                    x = block(x)
            except Exception as error:
                raise RuntimeError("wrapped: the blocks failed") from error
            return self.lm_head(self.ln_f(x))

    class WrappedForward(NanoGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = WrappingGPT(self.model.config)

        def forward(self, idx: Tensor) -> Tensor:
            try:  # the module: the network call wrapped, its failures re-raised as the user's error
                return self.model(idx)
            except Exception as error:
                raise RuntimeError("wrapped: the network failed") from error

    classes = {"posemb_gpt": PosEmbGPT, "nanogpt_tied_aux_head": TiedAuxHead, "nanogpt_rank_marker": RankMarker,
               "late_norm_gpt": LateNorm, "positions_again_gpt": PositionsAgain, "scaled_between_gpt": ScaledBetween,
               "wrapped_forward_gpt": WrappedForward}  # fmt: skip
    return classes[model](**kwargs) if model in classes else None
