"""Modules for the context-parallel tests (tests/test_context_parallel.py): a Hugging Face Llama whose loss is its own
(``labels=``, shifted inside the model), with some labels ignored, so that the context ranks count different numbers
of tokens; and two whose own loss in ``training_step`` is not exact under context parallel (targets shifted inside
the step; tokens ignored unevenly over the parts), which the first-step check refuses."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F

from tests.zoo_models import HFCausalLM


class HFLabelsLM(HFCausalLM):
    """``model(input_ids, labels=input_ids)``: transformers shifts the labels inside its loss, across what context
    parallel makes a boundary between ranks; every token whose id is a multiple of 5 is ignored (-100). The loss is
    logged without ``sync_dist``. It counts its calls on ``self`` and appends to a list after the network call (the
    first step's probe of the loss runs the step again: none of that may show), and prints."""

    ignores_tokens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.after: list[int] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        labels = x.masked_fill(x % 5 == 0, -100) if self.ignores_tokens else x
        loss = self.model(input_ids=x, labels=labels).loss
        self.calls += 1
        self.after.append(batch_idx)
        print(f"training_step call {self.calls}", flush=True)
        # logged as a one-device script logs it (no sync_dist): under context parallel each rank's own loss is its
        # part's, and what is logged must be the batch's (the context ranks' mean)
        self.log("train_loss", loss)
        return loss


class HFCountedLabelsLM(HFLabelsLM):
    """:class:`HFLabelsLM` with no token ignored: under a pipeline each micro-batch's loss is its own tokens' mean, as
    under "ddp" with accumulation, which equals one device's whole-batch mean only when every micro-batch counts the
    same number of labels."""

    ignores_tokens = False


class HFShiftInsideLM(HFCausalLM):
    """Next-token loss shifted inside the step (``logits[:, :-1]`` against ``x[:, 1:]``): one device counts every pair,
    each context rank loses the pair across its part's boundary."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


class HFIgnoredTokensLM(HFCausalLM):
    """``F.cross_entropy(ignore_index=-100)`` on pre-shifted targets whose last quarter of each sequence is ignored
    (as padding labels at the end would be; marked on the whole batch, before the strategy cuts it): at cp2 the
    second rank's part counts half its tokens, the first all of them, and the mean of their means weighs them
    equally. The ignored positions lie after the first positions of the part, which a probe of each part's beginning
    alone would not see."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x, y.clone().index_fill_(1, torch.arange(y.size(1) * 3 // 4, y.size(1)), -100)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, targets = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


_CONTEXT_MODULES = {"cp-labels-": HFLabelsLM, "cp-counted-": HFCountedLabelsLM, "cp-shift-inside-": HFShiftInsideLM,
                    "cp-ignored-": HFIgnoredTokensLM}


def build_context_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    """``"cp-labels-<family>"`` -> :class:`HFLabelsLM`, ``"cp-counted-<family>"`` -> :class:`HFCountedLabelsLM`,
    ``"cp-shift-inside-<family>"`` -> :class:`HFShiftInsideLM`, ``"cp-ignored-<family>"`` -> :class:`HFIgnoredTokensLM`;
    None for other names."""
    for prefix, cls in _CONTEXT_MODULES.items():
        if model.startswith(prefix):
            return cls(model[len(prefix) :], **kwargs)
    return None
