"""Where the pipeline cuts a forward it did not write, against one device (fp32, 1e-5) or refused before any step:

- OPT at pp=2: its decoder registers ``final_layer_norm`` before ``layers`` and calls it after them; the cut followed
  registration order and refused it at the first step (no gradient on the first stage's copy). The order is now the
  forward's own, seen in a meta forward of ``example_input_array``, and OPT trains like one device;
- T5 at pp=2: an encoder-decoder has two block lists, and only one is cut: refused at set-up, naming both;
- a Hugging Face pipeline plan (``_pp_plan``) orders the modules of a module without ``example_input_array``, and a
  module called on both sides of the blocks is kept on every stage (in-process checks of the cut, no launch);
- vision networks (tests/vision_models.py) at pp=2: a hierarchical ViT whose blocks change the hidden state's shape
  (it crashed in the first backward: the boundary was sized as the first block's input), a CNN whose blocks return
  channels-last views (it crashed sending a non-contiguous tensor), a ViT whose ``mask_token`` gets no gradient on
  one device either (it was refused for that); the hierarchical ViT whose forward cannot run on meta tensors is
  refused at the first step, and a shape change between blocks outside them is refused where a stage would end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.pipeline import partition_blocks, split_network
from lightning_hybrid.pipeline.boundaries import contiguous_gradient, meta_copy, trace_unsplit_forward
from lightning_hybrid.pipeline.stage import InputStub, OutputStub, io_slots
from tests.conftest import share
from tests.harness import check_trained_or_refused

TOL = 1e-5
PP2 = {"pipeline_parallel_size": 2}


def _case(name: str, model: str, refusal: str = "", dataset: str = "tokens") -> dict[str, Any]:
    return {"name": f"cuts-{name}-pp2", "model": model, "model_kwargs": {}, "dataset": dataset, "strategy": PP2,
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
    _case("hierarchical-vit", "hierarchical_vit", dataset="images"),
    _case("channels-last-cnn", "channels_last_cnn", dataset="images"),
    _case("masked-vit", "masked_vit", dataset="images"),
    _case(
        "checked-hierarchical-vit",
        "checked_hierarchical_vit",
        r"HybridConfigError: The pipeline cut does not fit this network's forward, which would train wrong: pipeline"
        r" stage 0 ends with `layers\.0`, whose output \(\[2, 16, 32\]\) is not the \[2, 64, 16\] the stage boundary"
        r" carries\. The network's forward could not run on meta tensors",
        dataset="images",
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


def test_the_boundaries_follow_the_shapes_and_one_device_tells_which_parameters_get_gradients() -> None:
    """Read off a meta forward of the unsplit network (no launch): the hierarchical ViT's second stage receives the
    merged hidden state, and the masked ViT's ``mask_token`` is no parameter one device differentiates."""
    from tests.vision_models import HierarchicalViTNet, MaskedViTNet

    images = torch.zeros(2, 3, 8, 8)
    trace = trace_unsplit_forward(meta_copy(HierarchicalViTNet()), "layers", (images,), {}, training=True)
    assert trace is not None
    assert [s.shape for s in trace.stage_inputs(partition_blocks(2, 2), "layers")] == [(2, 64, 16), (2, 16, 32)]
    net = MaskedViTNet()
    trace = trace_unsplit_forward(meta_copy(net), "blocks", (images,), {}, training=True)
    assert trace is not None
    assert {n for n, _ in net.named_parameters()} - trace.used == {"embeddings.mask_token"}
    masked = {"bool_masked_pos": torch.zeros(2, 16, dtype=torch.bool)}
    trace = trace_unsplit_forward(meta_copy(net), "blocks", (images,), masked, training=True)
    assert trace is not None and "embeddings.mask_token" in trace.used


class _MergesBetweenBlocks(nn.Module):
    """Merges pairs of rows between its second and third block, in its own forward, outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x.reshape(x.shape[0] // 2, 16) if i == 2 else x)
        return x


def test_a_shape_change_between_blocks_outside_them_is_refused_where_a_stage_would_end() -> None:
    trace = trace_unsplit_forward(meta_copy(_MergesBetweenBlocks()), "blocks", (torch.zeros(4, 8),), {}, training=True)
    assert trace is not None
    assert [s.shape for s in trace.stage_inputs(partition_blocks(3, 2, partition=[1, 2]), "blocks")] == [(4, 8), (4, 8)]
    with pytest.raises(
        HybridConfigError,
        match=r"the cut \[2, 1\] ends a pipeline stage after `blocks\.1`, whose output has shape \[4, 8\], but the"
        r" network's forward changes the hidden state to shape \[2, 16\] before `blocks\.2`, outside the blocks.*"
        r"A stage may end after blocks \[0\] \(0-based\): give `pipeline_partition` as a list of block counts",
    ):
        trace.stage_inputs(partition_blocks(3, 2, partition=[2, 1]), "blocks")


def test_a_received_activation_hands_on_a_contiguous_gradient() -> None:
    """The zero-bubble schedules take a stage's input gradient from ``torch.autograd.grad``, which keeps the layout
    of a block that starts with a view of its input (a channels-last permute); c10d sends contiguous buffers."""
    received = torch.randn(2, 4, 4, 3, requires_grad=True)
    head = nn.Linear(48, 5)  # reads the channels-first pixels of a channels-last activation, flattened

    def block(x: torch.Tensor) -> torch.Tensor:
        return head(x.permute(0, 3, 1, 2).reshape(2, -1))

    plain = torch.autograd.grad(block(received).sum(), received)[0]
    assert not plain.is_contiguous()  # what the send would have been handed
    wrapped = torch.autograd.grad(block(contiguous_gradient(received)).sum(), received)[0]
    assert wrapped.is_contiguous() and torch.equal(wrapped, plain)
