"""What crosses a pipeline stage boundary (issue 44), on networks written for it (tests/boundary_models.py), at pp=2
in the shared 2-process launch, against one device of the same module, data and seed:

- **each tensor's own dtype** under ``bf16-mixed`` and ``16-mixed`` (fp16 autocast on CPU: ``HybridPrecision`` as a
  plugin, the reference with Lightning's ``MixedPrecision("16-mixed", "cpu")``): an MLP, a graph network and a U-Net
  (skips inside one stage) whose blocks return autocast's dtype while the first takes fp32. The receive buffers were
  made in the first block's input dtype: an MLP ended 7e-2 off with 1F1B and NaN with GPipe, others aborted in gloo
  ("Received data size doesn't match expected size"). Each model in each precision with 1F1B, GPipe and interleaved
  1F1B, within the 16-bit tolerances below;
- **connections across stages**: a U-Net whose skip runs from its first level to its last, at pp=2 under
  ``bf16-mixed`` (``verify_pipeline`` "auto" is off in 16-bit), trained 0.38 off in silence: refused before
  training on every rank, by the structural check of the trace (in one process: the fix it names, a partition
  keeping both ends in one stage, is accepted);
- **stand-ins that return what the block returns**: decoder layers returning ``(hidden, attention weights)`` and
  vision stages returning ``(tokens, (height, width))`` were refused at pp=2 ("too many values to unpack"): they
  train like one device (fp32, 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.pipeline import partition_blocks, split_network
from lightning_hybrid.pipeline.boundaries import meta_copy, trace_unsplit_forward
from lightning_hybrid.pipeline.stage import SkippedBlock
from tests.conftest import relative_error, share
from tests.harness import check_trained_or_refused, run_reference

STEPS = 3
FP16_SCALE = 2.0**8
"""The fp16 loss scale of both sides (no overflow at it on these models: the scale stays put over the steps)."""
LOSS_TOLERANCE, GRADIENT_TOLERANCE, PARAMETER_TOLERANCE = 1e-3, 1e-2, 1e-3
"""16-bit, relative: per-step loss, per-tensor first-step gradient and final parameter. A pipeline's micro-batches
round each activation to bf16/fp16 as one device does, but their matmuls over 2 samples accumulate in another order
than over 4 (2**-8 = 3.9e-3 is bf16's rounding of one value). Measured at most 1e-5 (loss), 3.6e-3 (bf16) and
4.9e-4 (fp16) (gradients), 6.5e-5 (parameters). The defect this guards against moved the loss by 0.26 (MLP, 1F1B)
and the gradients by 0.15 (graph network), or gave NaN (MLP, interleaved)."""

SCHEDULES: dict[str, dict[str, Any]] = {
    "1f1b": {"pipeline_schedule": "1f1b"},
    "gpipe": {"pipeline_schedule": "gpipe"},
    "interleaved": {"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2},
}
MODELS = ("boundary_mlp", "boundary_graph", "boundary_unet")


def _case(name: str, model: str, schedule: str, refusal: str = "", **extra: Any) -> dict[str, Any]:
    strategy = {"pipeline_parallel_size": 2, "num_microbatches": 2, **SCHEDULES[schedule]}
    return {"name": name, "model": model, "model_kwargs": extra.pop("model_kwargs", {}),
            "dataset": "tokens" if model == "boundary_hybrid" else "images", "strategy": strategy, "steps": STEPS,
            "batch_size": 4, "data_parallel_size": 1, "refusal": refusal, **({"expect_error": True} if refusal else {}),
            **extra}  # fmt: skip


def _precision(kind: str) -> dict[str, Any]:
    if kind == "bf16":
        return {"trainer": {"precision": "bf16-mixed"}}
    # Lightning turns Trainer(precision="16-mixed") into bf16 on CPU: the plugin asks for fp16 explicitly
    return {"precision_plugin": {"precision": "16-mixed", "initial_scale": FP16_SCALE}}


MIXED = [
    _case(f"bounds-{model.removeprefix('boundary_')}-{kind}-{schedule}-pp2", model, schedule, **_precision(kind))
    for model in MODELS
    for kind in ("bf16", "fp16")
    for schedule in SCHEDULES
]
CROSSING = _case(
    "bounds-unet-skip-across-bf16-pp2",
    "boundary_unet",
    "1f1b",
    r"HybridConfigError: `pipeline_parallel_size` > 1: the cut \[2, 2\] of `levels` separates values the forward"
    r" passes outside the hidden state from where they are read: `levels\.2` \(stage 1\) takes a tensor `levels\.1`"
    r" returns besides its hidden state \(stage 0\) as its argument `1`; `levels\.3` \(stage 1\) takes a tensor"
    r" `levels\.0` returns .* No partition of the 4 blocks into 2 stages keeps both ends of each in one stage: train"
    r" this model without pipeline parallel",
    model_kwargs={"pattern": "DDUU"},
    trainer={"precision": "bf16-mixed"},
)
TUPLES = [
    _case("bounds-hybrid-layers-pp2", "boundary_hybrid", "1f1b"),
    _case("bounds-pyramid-sizes-pp2", "boundary_pyramid", "interleaved"),
]
# the plan the refusal of a fused query_key_value without example_input_array gives as its example (below): BLOOM
# trains with it; Falcon's forward adds its attention's output into the MLP's in place, which a split layer's output
# cannot take: refused naming that
MLP_PLAN = {"model.transformer.h.*.mlp.dense_h_to_4h": "colwise", "model.transformer.h.*.mlp.dense_4h_to_h": "rowwise"}
REMEDIES = [
    {"name": f"remedy-{family}-mlp-plan-tp2", "model": f"hf-{family}", "model_kwargs": {"example_input": False},
     "dataset": "tokens", "strategy": {"tensor_parallel_size": 2, "tensor_parallel_plan": MLP_PLAN}, "steps": STEPS,
     "batch_size": 4, "data_parallel_size": 1, "refusal": refusal, **({"expect_error": True} if refusal else {})}
    for family, refusal in [
        ("bloom", ""),
        ("falcon", r"HybridConfigError: `tensor_parallel_size=2`: the forward failed in `model\.transformer\.h\.0`"
                   r" \(FalconDecoderLayer\).* Its forward modifies the output of a split layer in place"),
    ]
]  # fmt: skip
share(2, [*MIXED, CROSSING, *TUPLES, *REMEDIES])


def _one_device(name: str) -> dict[str, Any]:
    case = next(c for c in MIXED if c["name"] == name)
    plugins = None
    if case.get("precision_plugin"):
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    return run_reference({k: v for k, v in case.items() if k not in ("strategy", "refusal")}, plugins=plugins)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", MIXED, ids=[c["name"] for c in MIXED])
def test_boundaries_carry_each_tensors_dtype_under_16_bit_autocast(shared_groups, case: dict[str, Any]) -> None:
    result = shared_groups(2).get(case["name"])
    reference = _one_device(case["name"])
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) / abs(want) <= LOSS_TOLERANCE, f"step {step}: loss {got} vs one device {want}"
    for kind, tolerance in (("params", PARAMETER_TOLERANCE), ("grads", GRADIENT_TOLERANCE)):
        assert result[kind].keys() == reference[kind].keys(), kind
        for name, want in reference[kind].items():
            assert torch.isfinite(result[kind][name]).all(), f"{kind} {name}"
            err = relative_error(result[kind][name], want)
            assert err <= tolerance, f"{kind} {name}: relative error {err:.2e}"


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", [CROSSING, *TUPLES], ids=[c["name"] for c in [CROSSING, *TUPLES]])
def test_stand_ins_return_what_blocks_return_and_skips_across_stages_are_refused(shared_groups, case: dict) -> None:
    check_trained_or_refused(shared_groups(2), case, world=2, tolerance=1e-5)


@pytest.mark.parametrize("family", ["falcon", "bloom"])
def test_a_fused_qkv_refusal_gives_an_example_plan_in_the_models_own_names(family: str) -> None:
    """A fused ``query_key_value`` (a name the table does not know) without ``example_input_array``: the refusal's
    example plan named ``attn.q``, which no such model has. Now the MLP pair of its own names, which the strategy
    accepts (the attention stays replicated: Falcon's one key/value head divides nothing), and which trains
    (``remedy-*-mlp-plan-tp2`` below)."""
    import ast
    import re

    from lightning_hybrid.structure import find_model_structure
    from lightning_hybrid.tensor_parallel.apply import validate_tensor_parallel_plan
    from lightning_hybrid.tensor_parallel.plan import build_tensor_parallel_plan
    from tests.zoo_models import HFCausalLM

    module = HFCausalLM(family, example_input=False)
    structure = find_model_structure(module)
    with pytest.raises(HybridConfigError, match=r"give a plan in this model's layer names, e\.g\.") as refused:
        build_tensor_parallel_plan(module, structure)
    example = ast.literal_eval(re.search(r"`tensor_parallel_plan=(\{.*?\})`", str(refused.value)).group(1))
    assert example == MLP_PLAN
    plan = build_tensor_parallel_plan(module, structure, example)
    validate_tensor_parallel_plan(module, plan, 2)


def test_dbrx_experts_are_refused_by_expert_parallel_naming_their_form() -> None:
    """docs/expert-parallel.md named DBRX among the families expert parallel dispatches; its experts keep every
    expert's rows stacked in 2-D matrices of a child module, and were refused as holding "no packed expert weights"."""
    import transformers

    from lightning_hybrid.expert_parallel import find_expert_modules

    config = transformers.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    )  # fmt: skip
    found, refused = find_expert_modules(transformers.DbrxForCausalLM(config))
    assert found == [] and set(refused) == {f"transformer.blocks.{i}.ffn.experts" for i in range(2)}
    assert all("(mlp.w1, mlp.v1, mlp.w2) are 2-D matrices stacking every expert's rows" in r for r in refused.values())


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", REMEDIES, ids=[c["name"] for c in REMEDIES])
def test_the_example_plan_trains_or_is_refused_naming_the_real_reason(shared_groups, case: dict[str, Any]) -> None:
    """Losses and first-step gradients within 1e-5 of one device, final parameters too but BLOOM's fused q|k|v bias:
    its key part's true gradient is exactly zero (softmax ignores a constant per row), and Adam turns that gradient's
    rounding noise into full steps (docs/testing.md, "Why the nanoGPT tests use bias=False"): measured 1.3e-5."""
    if case["refusal"]:
        messages = check_trained_or_refused(shared_groups(2), case, world=2)
        assert all("train this model with data or pipeline parallel" in m for m in messages), messages
        return
    result = shared_groups(2).get(case["name"])
    reference = run_reference({k: v for k, v in case.items() if k not in ("strategy", "refusal")})
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert abs(got - want) / abs(want) <= 1e-5, f"step {step}: loss {got} vs one device {want}"
    for kind in ("grads", "params"):
        assert result[kind].keys() == reference[kind].keys(), kind
        for name, want in reference[kind].items():
            tolerance = 1e-4 if kind == "params" and name.endswith("query_key_value.bias") else 1e-5
            assert relative_error(result[kind][name], want) <= tolerance, f"{kind} {name}"


# ---------------------------------------------------------------------------------------------- in one process
def _trace(net: nn.Module, blocks: str, x: torch.Tensor, **kwargs: Any) -> Any:
    trace = trace_unsplit_forward(meta_copy(net), blocks, (x,), {}, training=True, **kwargs)
    assert trace is not None
    return trace


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_trace_shows_the_dtype_the_steps_autocast_computes(dtype: torch.dtype) -> None:
    from tests.boundary_models import MLPNet, UNetNet

    images, cpu = torch.zeros(4, 3, 8, 8), torch.device("cpu")
    plan = partition_blocks(4, 2)
    assert [s.dtype for s in _trace(MLPNet(), "layers", images).stage_inputs(plan, "layers")] == [torch.float32] * 2
    with torch.autocast("cpu", dtype=dtype):
        specs = _trace(MLPNet(), "layers", images, device=cpu).stage_inputs(plan, "layers")
        # the first block takes the images as they come; what a stage sends is what its last block computes
        assert [(s.shape, s.dtype) for s in specs] == [((4, 192), torch.float32), ((4, 32), dtype)]
        trace = _trace(UNetNet(), "levels", images, device=cpu)
    assert [(s.shape, s.dtype) for s in trace.stage_inputs(partition_blocks(8, 4), "levels")] == [
        ((4, 3, 8, 8), torch.float32), *[((4, 8, 8, 8), dtype)] * 3,
    ]  # fmt: skip


def test_a_skip_across_a_cut_is_refused_naming_the_partition_that_keeps_it_in_one_stage() -> None:
    from tests.boundary_models import UNetNet

    trace = _trace(UNetNet("DUDDUU"), "levels", torch.zeros(2, 3, 8, 8))
    with pytest.raises(
        HybridConfigError,
        match=r"the cut \[3, 3\] of `levels` .*: `levels\.5` \(stage 1\) takes a tensor `levels\.2` returns besides"
        r" its hidden state \(stage 0\) as its argument `1`\..* Give `pipeline_partition=\[2, 4\]`, which keeps both"
        r" ends of each in one stage",
    ):
        trace.stage_inputs(partition_blocks(6, 2), "levels")
    # the fix it names is taken
    assert len(trace.stage_inputs(partition_blocks(6, 2, partition=[2, 4]), "levels")) == 2


class _PositionsAfterTheBlocks(nn.Module):
    """Adds the position embedding's output again after its blocks: the last stage holds only a zero stand-in for it,
    and every parameter still gets a gradient there."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(16, 8), nn.Embedding(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.positions(torch.arange(ids.shape[1]))
        h = self.tokens(ids) + positions
        for block in self.blocks:
            h = block(h)
        return self.head(h + positions)


def test_an_input_modules_output_read_after_the_blocks_is_refused_before_the_numeric_check() -> None:
    net = _PositionsAfterTheBlocks()
    trace = trace_unsplit_forward(
        meta_copy(net), "blocks", (torch.zeros(2, 4, dtype=torch.long),), {}, training=True,
        inputs=("tokens", "positions"),
    )  # fmt: skip
    assert trace is not None
    with pytest.raises(
        HybridConfigError,
        match=r"the network's output \(stage 1\) is computed from the output of `positions` \(an input module: stage"
        r" 0 holds it, the others a zero stand-in\).*No partition of the 4 blocks into 2 stages",
    ):
        trace.stage_inputs(partition_blocks(4, 2), "blocks")


def test_a_stand_in_returns_the_blocks_tuple_and_the_sizes_the_forward_reads() -> None:
    """The last stage of the pyramid network runs the stand-ins of the first stage's stages: they return
    ``(tokens, (height, width))`` with the merged grid's size, which the forward hands to the stage that receives the
    activation. Without the trace they return what the block's meta copy returns on meta inputs."""
    from lightning_hybrid.pipeline.step_data import StepContext
    from tests.boundary_models import PyramidNet

    torch.manual_seed(0)
    net = PyramidNet()
    images = torch.randn(2, 3, 8, 8)
    trace = _trace(net, "stages", images)
    received = torch.randn(2, 4, 32)  # what stage 0 sends: stage 1's merged tokens
    want = net.head(net.stages[3](*net.stages[2](received, (2, 2)))[0].mean(1))
    for learned in (trace, None):
        torch.manual_seed(0)
        net = PyramidNet()
        split = split_network(net, "stages", partition_blocks(4, 2), pipeline_rank=1)
        split.learn(learned)
        assert isinstance(net.stages[1], SkippedBlock)
        assert net.stages[1](torch.zeros(2, 16, 16), (4, 4))[1] == (2, 2)
        step = StepContext("training_step", [images], (), [((images,), {})], run_stage=lambda *_: None)
        step.active = (1, received)
        with split.attached(step), split.active(1):
            got = net(images)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
