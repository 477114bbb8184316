"""The model zoo: architectures written by others, built from tiny configs (no downloads), each trained at dp=2 ZeRO-3,
pp=2, tp=2 and tp2 x pp2 x dp2 ZeRO-3 against one device of the same module, data and seed (fp32, 1e-5 relative).

``ZOO`` says, per (model, layout), whether the layout trains like one device or is refused with a
``HybridConfigError`` before the first optimizer step, and by which words: a regression in either direction (a
refusal that starts training, a layout that trained and is now refused, crashes or drifts) fails here. The table is
the one in docs/models.md.

All 2-process layouts of all models run in the session's shared 2-process launch, the 3D ones in the shared
8-process launch. Few steps on tiny models: a wrong cut, plan or shard moves the loss or the gradients by far more
than 1e-5 at the first step already.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from tests.conftest import relative_error, share
from tests.harness import run_reference

STEPS = 3
BATCH = 4
TOL = 1e-5

# model -> (model_kwargs, dataset)
MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "litgpt_llama": ({"n_layer": 2}, "tokens"),
    "litgpt_pythia": ({"n_layer": 2}, "tokens"),
    "hf-gpt2": ({}, "tokens"),
    "hf-gpt_neox": ({}, "tokens"),
    "hf-phi3": ({}, "tokens"),
    "hf-mixtral": ({}, "tokens"),
    "hf-qwen3": ({}, "tokens"),
    "hf-llama": ({}, "tokens"),
    "hf-bert": ({}, "tokens"),
    "hf-vit": ({}, "images"),
    "torch-encoder": ({}, "tokens"),
    "cnn": ({"bn_replicas": 2}, "images"),
    "mlp": ({}, "images"),
    "lightning_mp": ({}, "tokens"),
}
# layout -> (strategy, data-parallel size, world)
LAYOUTS: dict[str, tuple[dict[str, Any], int, int]] = {
    "dp2-zero3": ({"zero_stage": 3}, 2, 2),
    "pp2": ({"pipeline_parallel_size": 2}, 1, 2),
    "tp2": ({"tensor_parallel_size": 2}, 1, 2),
    "tp2-pp2-dp2": ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 3}, 2, 8),
}
MATCH = "match"
# (model, layout) -> MATCH, or a regular expression the HybridConfigError on every rank must match
ZOO: dict[tuple[str, str], str] = {(model, layout): MATCH for model in MODELS for layout in LAYOUTS}
_GQA = r"attn.qkv' is split as 3 equal fused blocks \(q\|k\|v\), but its attention has n_head=4, n_query_groups=2"
_NO_BLOCKS = r"Could not find the repeated transformer blocks in {} .*`pipeline_parallel_size=2` \(the pipeline"
_NO_BLOCKS_TP = r"Could not find the repeated transformer blocks in {} .*`tensor_parallel_plan='auto'`"
ZOO.update({
    # litgpt's fused qkv under grouped-query attention holds unequal q|k|v parts: no tensor-parallel layout splits it
    ("litgpt_llama", "tp2"): _GQA, ("litgpt_llama", "tp2-pp2-dp2"): _GQA,
    # no repeated block list: nothing to cut into stages, no layers to read an automatic plan from
    ("cnn", "pp2"): _NO_BLOCKS.format("SmallCNN"), ("cnn", "tp2"): _NO_BLOCKS_TP.format("SmallCNN"),
    ("cnn", "tp2-pp2-dp2"): _NO_BLOCKS.format("SmallCNN"),
    ("mlp", "pp2"): _NO_BLOCKS.format("SmallMLP"), ("mlp", "tp2-pp2-dp2"): _NO_BLOCKS.format("SmallMLP"),
    # configure_model applied fully_shard to the whole model, as written for ModelParallelStrategy: a pipeline shards
    # each stage itself
    ("lightning_mp", "tp2-pp2-dp2"): r"`pipeline_parallel_size=2`, but the LightningModule's `configure_model`",
})  # fmt: skip
# a layout's strategy arguments beyond LAYOUTS' for one model: the MLP's tensor-parallel plan as a user gives it
EXTRA: dict[tuple[str, str], dict[str, Any]] = {
    ("mlp", "tp2"): {"tensor_parallel_plan": {"body.0": "colwise", "body.2": "rowwise"}},
}


def scenario(model: str, layout: str) -> dict[str, Any]:
    kwargs, dataset = MODELS[model]
    strategy, dp, _ = LAYOUTS[layout]
    expected = ZOO[(model, layout)]
    return {"name": f"zoo-{model}-{layout}", "model": model, "model_kwargs": kwargs, "dataset": dataset,
            "strategy": {**strategy, **EXTRA.get((model, layout), {})}, "steps": STEPS, "batch_size": BATCH,
            "data_parallel_size": dp, **({"expect_error": True} if expected != MATCH else {})}  # fmt: skip


CASES = [scenario(model, layout) for model, layout in ZOO]
for _world in (2, 8):
    share(_world, [scenario(m, la) for m, la in ZOO if LAYOUTS[la][2] == _world])


def _case(model: str, layout: str) -> dict[str, Any]:
    return next(c for c in CASES if c["name"] == f"zoo-{model}-{layout}")


@functools.cache
def _reference(model: str, dp: int) -> dict[str, Any]:
    """One device, the global batches of ``dp`` replicas: the ground truth of every layout of that model."""
    kwargs, dataset = MODELS[model]
    return run_reference({"name": "reference", "model": model, "model_kwargs": kwargs, "dataset": dataset,
                          "steps": STEPS, "batch_size": BATCH, "data_parallel_size": dp})  # fmt: skip


@functools.cache
def _tied(model: str) -> dict[str, str]:
    """Second name -> first name of each tied parameter: the pipeline keeps a copy on each stage that uses it, the
    reference one tensor under the first name."""
    from lightning_hybrid.structure import find_model_structure
    from tests.harness import build_module

    return {
        second: first for first, second in find_model_structure(build_module(model, **MODELS[model][0])).tied_parameters
    }


def _worst_error(model: str, result: dict[str, Any], reference: dict[str, Any]) -> tuple[float, str]:
    """The largest relative error of the per-step losses, the final parameters and the first-step gradients (every
    copy of a tied parameter against the one tensor of the reference)."""
    errors = [(abs(got - want) / abs(want), f"loss at step {step}")
              for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True))]  # fmt: skip
    tied = _tied(model)
    for kind in ("params", "grads"):
        assert {tied.get(n, n) for n in result[kind]} == reference[kind].keys(), kind
        errors += [
            (relative_error(got, reference[kind][tied.get(n, n)]), f"{kind} {n}") for n, got in result[kind].items()
        ]
    return max(errors, key=lambda e: e[0])


@pytest.fixture(scope="session")
def groups(shared_groups):
    return shared_groups


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("model", "layout"), list(ZOO), ids=[f"{m}-{la}" for m, la in ZOO])
def test_zoo_layout_trains_like_one_device_or_is_refused(groups, model: str, layout: str) -> None:
    case = _case(model, layout)
    _, dp, world = LAYOUTS[layout]
    group = groups(world)
    expected = ZOO[(model, layout)]
    if expected != MATCH:
        messages = group.expected_errors(case["name"])
        assert len(messages) == world, f"expected the refusal on all {world} ranks, got {messages}"
        assert len(set(messages)) == 1, messages
        assert messages[0].startswith("HybridConfigError") and re.search(expected, messages[0]), messages[0]
        return
    result = group.get(case["name"])
    assert len(result["losses"]) == STEPS
    reference = _reference(model, dp)
    err, where = _worst_error(model, result, reference)
    assert err <= TOL, f"{where}: relative error {err:.2e}"
    if LAYOUTS[layout][0].get("tensor_parallel_size", 1) > 1:  # the plan really split layers: less than all per rank
        total = sum(p.numel() for p in reference["params"].values())
        assert all(record["local_numel"] < total for record in result["per_rank"]), "nothing was split"


# ------------------------------------------------------------------------------------------------ single process
class _PatchEmbed(torch.nn.Module):
    """An input module that is neither an embedding nor a linear layer, with a parameter of its own (ViT's)."""

    def __init__(self) -> None:
        super().__init__()
        self.projection = torch.nn.Linear(4, 8)
        self.position = torch.nn.Parameter(torch.zeros(1, 3, 8))
        self.num_patches = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x) + self.position


class _ReadsAttributes(torch.nn.Module):
    """A forward that reads attributes of modules other stages hold and builds a block input from the embedding's
    output: its dtype and patch count, the first block's width, a scale sized like the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = _PatchEmbed()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.embeddings.projection.weight.dtype)
        assert x.shape[1] == self.embeddings.num_patches and self.blocks[0].in_features == 8
        h = self.embeddings(x)
        scale = h.new_full(h.shape[-1:], 0.5)
        for block in self.blocks:
            h = block(h) * scale
        return self.head(h)


def test_a_later_stage_reads_the_attributes_of_what_other_stages_hold() -> None:
    """Before: ``'InputStub' object has no attribute 'projection'`` (HF ViT), ``'SkippedBlock' object has no
    attribute 'self_attn'`` (torch's nn.TransformerEncoder), and a stub shaped like its input, not its output."""
    from lightning_hybrid.pipeline import partition_blocks, split_network
    from lightning_hybrid.pipeline.step_data import StepContext

    torch.manual_seed(0)
    net = _ReadsAttributes()
    x, received = torch.randn(2, 3, 4), torch.randn(2, 3, 8)
    want = net.head(net.blocks[1](received) * 0.5)
    split = split_network(net, "blocks", partition_blocks(2, 2), pipeline_rank=1)
    assert [n for n, _ in net.named_parameters()] == ["blocks.1.weight", "blocks.1.bias", "head.weight", "head.bias"]
    assert net.embeddings.projection.weight.device.type == "meta"  # readable, but holds no memory
    step = StepContext("training_step", [x], (), [((x,), {})], run_stage=lambda *_: None, active=(1, received))
    with split.attached(step), split.active(1):
        got = net(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
