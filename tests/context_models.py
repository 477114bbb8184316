"""Modules for the context-parallel tests (tests/test_context_parallel.py): a Hugging Face Llama whose loss is its own
(``labels=``, shifted inside the model), with some labels ignored, so that the context ranks count different numbers
of tokens."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

from tests.zoo_models import HFCausalLM


class HFLabelsLM(HFCausalLM):
    """``model(input_ids, labels=input_ids)``: transformers shifts the labels inside its loss, across what context
    parallel makes a boundary between ranks; every token whose id is a multiple of 5 is ignored (-100). The loss is
    logged without ``sync_dist``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        labels = x.masked_fill(x % 5 == 0, -100)
        loss = self.model(input_ids=x, labels=labels).loss
        # logged as a one-device script logs it (no sync_dist): under context parallel each rank's own loss is its
        # part's, and what is logged must be the batch's (the context ranks' mean)
        self.log("train_loss", loss)
        return loss


def build_context_module(model: str, **kwargs: Any) -> Optional[L.LightningModule]:
    """``"cp-labels-<family>"`` -> :class:`HFLabelsLM`; None for other names."""
    if model.startswith("cp-labels-"):
        return HFLabelsLM(model[len("cp-labels-") :], **kwargs)
    return None
