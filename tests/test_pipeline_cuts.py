"""Where the pipeline cuts a forward it did not write, against one device (fp32, 1e-5) or refused before any step:

- OPT at pp=2: its decoder registers ``final_layer_norm`` before ``layers`` and calls it after them; the cut followed
  registration order and refused it at the first step (no gradient on the first stage's copy). The order is now the
  forward's own, seen in a meta forward of ``example_input_array``, and OPT trains like one device;
- T5 at pp=2: an encoder-decoder has two block lists, and only one is cut: refused at set-up, naming both;
- a Hugging Face pipeline plan (``_pp_plan``) orders the modules of a module without ``example_input_array``, and a
  module called on both sides of the blocks is kept on every stage (in-process checks of the cut, no launch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.pipeline import partition_blocks, split_network
from lightning_hybrid.pipeline.stage import InputStub, OutputStub, io_slots
from tests.conftest import share
from tests.harness import check_trained_or_refused

TOL = 1e-5
PP2 = {"pipeline_parallel_size": 2}


def _case(name: str, model: str, refusal: str = "") -> dict[str, Any]:
    return {"name": f"cuts-{name}-pp2", "model": model, "model_kwargs": {}, "dataset": "tokens", "strategy": PP2,
            "steps": 3, "batch_size": 4, "data_parallel_size": 1, "refusal": refusal,
            **({"expect_error": True} if refusal else {})}  # fmt: skip


CASES = [
    _case("opt", "hf-opt"),
    _case(
        "t5",
        "hf-seq2seq-t5",
        r"HybridConfigError: `pipeline_parallel_size` > 1: T5ForConditionalGeneration has several block lists"
        r" \(`encoder\.block`, `decoder\.block`\), as an encoder-decoder has; the pipeline cuts one block list"
        r" \(`decoder\.block`\) .* Train this model without pipeline parallel",
    ),
]
share(2, CASES)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_forward_cut_in_its_call_order_trains_like_one_device_or_is_refused(shared_groups, case: dict) -> None:
    check_trained_or_refused(shared_groups(2), case, world=2, tolerance=TOL)


class _NormFirst(nn.Module):
    """Registers its final norm before the blocks and calls it after them (OPT's decoder does)."""

    _pp_plan = {"emb": (["input_ids"], ["hidden_states"]), "blocks": (["hidden_states"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"])}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def test_a_declared_pipeline_plan_orders_the_cut_without_an_example() -> None:
    net = _NormFirst()  # no example_input_array anywhere: the declared plan is what tells
    split_network(net, "blocks", partition_blocks(2, 2), pipeline_rank=1, root=net)
    assert isinstance(net.emb, InputStub) and isinstance(net.norm, nn.LayerNorm)
    net = _NormFirst()
    split_network(net, "blocks", partition_blocks(2, 2), pipeline_rank=0, root=net)
    assert isinstance(net.norm, OutputStub) and isinstance(net.emb, nn.Embedding)


class _SharedNorm(nn.Module):
    """Calls one norm before the blocks and again after them: neither stage alone can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.example_input_array = torch.zeros(2, 4, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def test_a_module_called_on_both_sides_of_the_blocks_is_kept_on_every_stage() -> None:
    from lightning_hybrid.pipeline.stage import call_order

    net = _SharedNorm()
    inputs, outputs = io_slots(net, "blocks", call_order(net, "blocks", net))
    assert [s.attr for s in inputs] == ["emb"] and outputs == []
    for rank in (0, 1):
        net = _SharedNorm()
        split_network(net, "blocks", partition_blocks(2, 2), pipeline_rank=rank, root=net)
        assert isinstance(net.norm, nn.LayerNorm)


def test_an_encoder_decoder_is_refused_naming_both_block_lists() -> None:
    from tests.zoo_models import HFSeq2SeqLM

    module = HFSeq2SeqLM("bart")
    with pytest.raises(HybridConfigError, match=r"\(`model\.encoder\.layers`, `model\.decoder\.layers`\)"):
        split_network(module.model, "model.decoder.layers", partition_blocks(2, 2), pipeline_rank=0, root=module)
