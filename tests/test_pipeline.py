"""Issue: pipeline parallel. Every schedule, pipeline x tensor x data with ZeRO 1/2/3, tied weights, Hugging Face
Llama, communication once per step, Lightning callbacks, and configuration errors; against a single-process run."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest

from lightning_hybrid import HybridConfigError, HybridStrategy
from lightning_hybrid.pipeline import partition_blocks
from tests.conftest import share
from tests.test_foundation import CLIP_VALUE, assert_parity, assert_resume_is_exact, reference_for, scenario

SCHEDULES = {
    "gpipe": {},
    "1f1b": {},
    "interleaved_1f1b": {"virtual_pipeline_size": 2},
    "interleaved_zero_bubble": {"virtual_pipeline_size": 2},
    "zbv_zero_bubble": {"virtual_pipeline_size": 2},
}


def _pp(pp: int, schedule: str, m: int, **more: Any) -> dict[str, Any]:
    return {
        "pipeline_parallel_size": pp,
        "pipeline_schedule": schedule,
        "num_microbatches": m,
        **SCHEDULES[schedule],
        **more,
    }


LAYERS4 = {"n_layer": 4}
LAYERS8 = {"n_layer": 8}
LAYERS5 = {"n_layer": 5}
WORLD2 = [
    *[scenario(f"pp2-{s}", "nanogpt", _pp(2, s, 2), 1, model_kwargs=LAYERS4) for s in SCHEDULES],
    scenario("pp2-tied", "nanogpt", _pp(2, "1f1b", 4), 1, model_kwargs={**LAYERS4, "tie_weights": True}),
    *[
        scenario(f"pp2-{p}-partition", "nanogpt", _pp(2, "1f1b", 2, pipeline_partition=p), 1, model_kwargs=LAYERS5)
        for p in ("parameters", "profile")
    ],
    scenario("error-too-many-stages", "nanogpt", _pp(2, "1f1b", 2), 1, model_kwargs={"n_layer": 1}, expect_error=True),
    scenario("error-batch-not-divisible", "nanogpt", _pp(2, "gpipe", 3), 1, model_kwargs=LAYERS4, expect_error=True),
    # found on rank 0 alone (it profiles), raised on every rank instead of leaving the others in the broadcast
    {
        **scenario(
            "error-profile-no-example",
            "nanogpt",
            _pp(2, "1f1b", 2, pipeline_partition="profile"),
            1,
            model_kwargs=LAYERS4,
            expect_error=True,
        ),
        "model": "nanogpt_no_example",
    },
    scenario(
        "error-pipeline-network",
        "nanogpt",
        _pp(2, "1f1b", 2, pipeline_network="nonexistent"),
        1,
        model_kwargs=LAYERS4,
        expect_error=True,
    ),
    scenario(
        "error-virtual-not-dividing",
        "nanogpt",
        _pp(2, "interleaved_1f1b", 2),
        1,
        model_kwargs={"n_layer": 6},
        expect_error=True,
    ),  # fmt: skip
]
WORLD4 = [
    *[scenario(f"pp4-{s}", "nanogpt", _pp(4, s, 4), 1, model_kwargs=LAYERS8) for s in SCHEDULES],
    scenario(
        "llama-pp2-tp2",
        "llama",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2},
        1,
        model_kwargs={"num_hidden_layers": 4},
    ),  # fmt: skip
    *[
        scenario(
            f"pp2-dp2-zero{z}-m{m}",
            "nanogpt",
            {**_pp(2, "1f1b", m), "zero_stage": z},
            2,
            model_kwargs=LAYERS4,
            count_collectives=True,
        )  # fmt: skip
        for z in (0, 1, 2)
        for m in (2, 4)
    ],
    *[
        scenario(
            f"pp2-dp2-zero3-{sync}-m{m}",
            "nanogpt",
            {**_pp(2, "1f1b", m), "zero_stage": 3, "zero3_gradient_sync": sync},
            2,
            model_kwargs=LAYERS4,
            count_collectives=True,
        )  # fmt: skip
        for sync in ("per_step", "per_microbatch")
        for m in (2, 4)
    ],
    scenario(
        "pp2-dp2-callbacks",
        "nanogpt",
        _pp(2, "1f1b", 2),
        2,
        model_kwargs=LAYERS4,
        steps=6,
        validate=2,
        val_check_interval=3,
        logger="csv",
        trainer={"log_every_n_steps": 1},
        callbacks=[
            {
                "kind": "ModelCheckpoint",
                "monitor": "val_loss",
                "save_top_k": 1,
                "save_last": True,
                "filename": "{step}-{val_loss:.4f}",
            },
            {"kind": "EarlyStopping", "monitor": "val_loss", "patience": 100},
            {"kind": "LearningRateMonitor", "logging_interval": "step"},
        ],
    ),  # fmt: skip
]
# sequence parallel under the schedules: the stages send and receive each tensor-parallel rank's slice of the
# sequence (of the two zero-bubble schedules, the V-shaped one, whose last stage is on the first rank; interleaved
# zero-bubble's split backward is the same, its placement interleaved 1F1B's)
WORLD4 += [
    scenario(f"sp-tp2-pp2-{s}", "nanogpt", {**_pp(2, s, 2), "tensor_parallel_size": 2, "sequence_parallel": True}, 1,
             model_kwargs=LAYERS4)
    for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")
]  # fmt: skip
# a sequence the tensor-parallel ranks cannot split: refused on every stage before the first micro-batch, not only on
# the first stage's ranks (whose forward splits it) while the others wait for its activations
SP_TP2_PP2 = {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "sequence_parallel": True}
ODD_SEQUENCE = scenario("error-sp-odd-sequence-pp2", "nanogpt", SP_TP2_PP2, 1, model_kwargs=LAYERS4, expect_error=True)
WORLD4.append({**ODD_SEQUENCE, "dataset": "odd_tokens", "timeout_s": 120})
# bare parameters on the network (tests/pipeline_models.py): a learned position embedding read before the blocks and
# a gain read after them; every stage keeps them, their gradients are summed over the pipeline, the first stage owns
# them. pp=4 also has stages that read neither, and clipping checks that the global norm counts them once.
WORLD4 += [
    {**scenario("posemb-pp2-dp2-zero3", "nanogpt", {**_pp(2, "1f1b", 2), "zero_stage": 3}, 2, model_kwargs=LAYERS4),
     "model": "posemb_gpt"},
    {**scenario("posemb-pp4-clip", "nanogpt", _pp(4, "1f1b", 4), 1, model_kwargs=LAYERS4,
                trainer={"gradient_clip_val": 0.05}), "model": "posemb_gpt"},
    {**scenario("posemb-pp4-clip-value", "nanogpt", _pp(4, "1f1b", 4), 1, model_kwargs=LAYERS4,
                trainer=CLIP_VALUE), "model": "posemb_gpt"},
    # lm_head is tied to wte, but the automatic plan splits the later aux_head as the vocabulary head: the embedding
    # is split on stage 0 while its tied copy stays whole on stage 1
    {**scenario("error-tied-layouts-differ", "nanogpt",
                {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "vocab_parallel_loss": False}, 1,
                model_kwargs=LAYERS4, expect_error=True), "model": "nanogpt_tied_aux_head"},
]  # fmt: skip
WORLD8 = [
    scenario(
        f"tp2-pp2-dp2-zero{z}",
        "nanogpt",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "zero_stage": z},
        2,
        model_kwargs=LAYERS4,
    )  # fmt: skip
    for z in (1, 2, 3)
]
# the 3D layout with sequence parallel and virtual stages (cli_configs/multi_node.yaml's options), ZeRO-1 and ZeRO-3
WORLD8 += [
    scenario(f"sp-tp2-pp2-dp2-interleaved-zero{z}", "nanogpt",
             {**_pp(2, "interleaved_1f1b", 2), "tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": z},
             2, model_kwargs=LAYERS4)
    for z in (1, 3)
]  # fmt: skip
WORLD8.append(
    scenario(
        "tp2-pp2-dp2-zero3-per-microbatch",
        "nanogpt",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "zero_stage": 3, "zero3_gradient_sync": "per_microbatch"},
        2,
        model_kwargs=LAYERS4,
    )  # fmt: skip
)
WORLD8 += [
    scenario(
        f"tp2-pp2-dp2-zero{z}-clip",
        "nanogpt",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "zero_stage": z},
        2,
        model_kwargs=LAYERS4,
        trainer={"gradient_clip_val": 0.05},
    )  # fmt: skip
    for z in (1, 3)
]
# by value at ZeRO-3 (ZeRO-1: tests/test_precision.py's clip-value-2x2x2-zero1)
WORLD8.append(scenario("tp2-pp2-dp2-zero3-clip-value", "nanogpt", {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2,
                                                                  "zero_stage": 3}, 2, model_kwargs=LAYERS4,
                       trainer=CLIP_VALUE))  # fmt: skip
WORLD8 += [
    scenario(
        f"tp2-pp2-dp2-zero{z}-resume",
        "nanogpt",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "zero_stage": z},
        2,
        model_kwargs=LAYERS4,
        resume_after=3,
        batch_size=16,
    )  # fmt: skip
    for z in (1, 3)
]
WORLD8.append(
    scenario(
        "tp2-pp2-dp2-zero1-uninterrupted",
        "nanogpt",
        {**_pp(2, "1f1b", 2), "tensor_parallel_size": 2, "zero_stage": 1},
        2,
        model_kwargs=LAYERS4,
        batch_size=16,
    )  # fmt: skip
)
WORLD2.append(
    scenario(
        "pp2-tied-clip",
        "nanogpt",
        _pp(2, "1f1b", 2),
        1,
        model_kwargs={**LAYERS4, "tie_weights": True},
        trainer={"gradient_clip_val": 0.05},
    )  # fmt: skip
)
WORLD2.append(
    scenario("pp2-tied-clip-value", "nanogpt", _pp(2, "1f1b", 2), 1, model_kwargs={**LAYERS4, "tie_weights": True},
             trainer=CLIP_VALUE)
)
WORLD2.append(scenario("pp2-predict", "nanogpt", _pp(2, "1f1b", 2), 1, model_kwargs=LAYERS4, predict=True))
# modules written without this project in mind (tests/foreign_models.py): litgpt's GPT registers its lm_head before
# the block list; it used to be cut as an input module, and the loss sat at ln(vocab) with nothing trained
LITGPT = importlib.util.find_spec("litgpt") is not None  # installed by scripts/install.sh (test extra), --no-deps
FOREIGN = [
    {**scenario(f"{m}-pp2", "nanogpt", _pp(2, "1f1b", 2), 1), "model": m, "model_kwargs": {}}
    for m in (("litgpt_llama", "litgpt_pythia") if LITGPT else ())
]
# forwards that do not fit the cut: refused before the first optimizer step on every rank, by the structural checks
# of the first step alone (verify_pipeline off), by the trace's connections across the cut, and by verify_pipeline
# where every structural check passes
MISFITS = [
    {**scenario("error-late-norm-pp2", "nanogpt", _pp(2, "1f1b", 2, verify_pipeline=False), 1, model_kwargs=LAYERS4,
                expect_error=True), "model": "late_norm_gpt"},
    {**scenario("error-positions-again-pp2", "nanogpt", _pp(2, "1f1b", 2), 1, model_kwargs=LAYERS4,
                expect_error=True), "model": "positions_again_gpt"},
    {**scenario("error-scaled-between-pp2", "nanogpt", _pp(2, "1f1b", 2), 1, model_kwargs=LAYERS4,
                expect_error=True), "model": "scaled_between_gpt"},
]  # fmt: skip
WORLD2 += FOREIGN + MISFITS
# a module and network that wrap their calls in `try/except Exception` (tests/pipeline_models.py): the strategy's own
# control flow (the stage boundary, the capture of the network's inputs, the tensor-parallel plan's trace) is not an
# Exception they can catch, so they train like one device
WRAPPED = [
    {**scenario(name, "nanogpt", layout, 1, model_kwargs=LAYERS4), "model": "wrapped_forward_gpt"}
    for name, layout in (
        ("wrapped-forward-pp2", _pp(2, "1f1b", 2)),
        ("wrapped-forward-tp2", {"tensor_parallel_size": 2, "verify_tensor_parallel": True}),
    )
]
WORLD2 += WRAPPED
TIED_CLIP = {f"pp2-tied-clip{kind}": {"model.lm_head.weight": "model.wte.weight"} for kind in ("", "-value")}
GROUPS = {2: WORLD2, 4: WORLD4, 8: WORLD8}
PARITY = [s for group in GROUPS.values() for s in group if not s.get("expect_error") and not s.get("callbacks")]
TIED = {"pp2-tied": {"model.lm_head.weight": "model.wte.weight"}, **TIED_CLIP}


for _world, _scenarios in GROUPS.items():
    share(_world, _scenarios)


@pytest.fixture(scope="session")
def pipeline_groups(shared_groups):
    return shared_groups


def _group_of(s: dict[str, Any]) -> int:
    return next(world for world, group in GROUPS.items() if s in group)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", PARITY, ids=[s["name"] for s in PARITY])
def test_pipeline_parity_with_single_process(pipeline_groups, case: dict[str, Any]) -> None:
    result = pipeline_groups(_group_of(case)).get(case["name"])
    reference = reference_for(case)
    assert_parity(result, reference, TIED.get(case["name"]))
    if case["data_parallel_size"] == 1 and reference.get("logged"):
        # what the step logged, merged over micro-batches on the last stage and shared with every rank once per
        # step, is on rank 0 (a first-stage rank) what one device logs for the whole batch
        assert len(result["logged"]) == len(reference["logged"]), (result["logged"], reference["logged"])
        for step, (got, want) in enumerate(zip(result["logged"], reference["logged"])):
            assert abs(got - want) / abs(want) <= 1e-5, f"step {step}: logged train_loss {got} vs one device {want}"


SEQUENCE_PARALLEL = [s for s in PARITY if s["strategy"].get("sequence_parallel")]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", SEQUENCE_PARALLEL, ids=[s["name"] for s in SEQUENCE_PARALLEL])
def test_sequence_parallel_layouts_ran_as_asked(pipeline_groups, case: dict[str, Any]) -> None:
    """The parity above is of the layout asked for: sequence parallel on, with the schedule and virtual stages."""
    layout = pipeline_groups(_group_of(case)).get(case["name"])["layout"]
    asked = {k: case["strategy"][k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "sequence_parallel")}
    assert {k: layout[k] for k in asked} == asked, layout
    assert layout["pipeline_schedule"] == case["strategy"]["pipeline_schedule"], layout
    assert layout["virtual_pipeline_size"] == case["strategy"].get("virtual_pipeline_size", 1), layout


@pytest.mark.timeout(2400)
def test_sequence_parallel_refuses_a_sequence_it_cannot_split_on_every_rank(pipeline_groups) -> None:
    messages = pipeline_groups(4).expected_errors("error-sp-odd-sequence-pp2")
    assert len(messages) == 4 and len(set(messages)) == 1, messages
    assert messages[0] == (
        "HybridConfigError: `sequence_parallel=True` splits the sequence (dim 1, length 15) over 2 tensor-parallel"
        " ranks; use a sequence length divisible by it or turn it off."
    ), messages[0]


@pytest.mark.timeout(2400)
def test_3d_resume_equals_the_uninterrupted_run(pipeline_groups) -> None:
    group = pipeline_groups(8)
    assert_resume_is_exact(group.get("tp2-pp2-dp2-zero1-resume"), group.get("tp2-pp2-dp2-zero1-uninterrupted"), 3)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_data_parallel_collectives_do_not_grow_with_microbatches(pipeline_groups, zero_stage: int) -> None:
    group = pipeline_groups(4)
    counts = {m: group.get(f"pp2-dp2-zero{zero_stage}-m{m}")["collectives"] for m in (2, 4)}
    assert counts[2] and all(c > 0 for c in counts[2]), counts
    assert counts[2] == counts[4], f"data-parallel collectives per step changed with num_microbatches: {counts}"


@pytest.mark.timeout(2400)
def test_predict_runs_through_the_pipeline_and_returns_outputs_on_every_rank(pipeline_groups) -> None:
    """trainer.predict under pp=2: forward-only schedule; the last stage's logits reach rank 0 (a first-stage rank)
    and equal the single-device model's logits for the same final weights."""
    import torch

    from tests.harness import build_module, make_dataset

    case = next(s for s in WORLD2 if s["name"] == "pp2-predict")
    result = pipeline_groups(2).get("pp2-predict")
    module = build_module("nanogpt", **case["model_kwargs"])
    module.load_state_dict(result["params"])
    inputs = torch.stack([make_dataset()[i][0] for i in range(8)])
    with torch.no_grad():
        expected = module(inputs)
    assert result["predictions"].shape == expected.shape
    assert torch.allclose(result["predictions"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(2400)
def test_zero3_gradient_sync_choice_is_measured(pipeline_groups) -> None:
    """ZeRO-3 under a pipeline: 'per_step' reduce-scatters each stage's gradients once per step, 'per_microbatch'
    after every micro-batch; both gather parameters per micro-batch forward. The counts go to docs/pipeline.md."""
    group = pipeline_groups(4)
    counts = {
        (sync, m): group.get(f"pp2-dp2-zero3-{sync}-m{m}")["collectives"][-1]
        for sync in ("per_step", "per_microbatch")
        for m in (2, 4)
    }
    print("data-parallel collectives per step (ZeRO-3, pp=2 x dp=2, 4 blocks):", counts)
    for m in (2, 4):
        assert counts[("per_microbatch", m)] > counts[("per_step", m)], counts
    # 'per_step' keeps the parameters gathered from the first forward to the last backward: its collectives per step
    # do not grow with the number of micro-batches (docs/pipeline.md)
    assert counts[("per_step", 2)] == counts[("per_step", 4)], counts
    # per micro-batch reductions grow with m faster than the per-step mode's (whose growth is forward gathers only)
    growth = {sync: counts[(sync, 4)] - counts[(sync, 2)] for sync in ("per_step", "per_microbatch")}
    assert growth["per_microbatch"] > growth["per_step"], counts


@pytest.mark.timeout(2400)
def test_lightning_callbacks_under_pipeline_and_data_parallel(pipeline_groups) -> None:
    """ModelCheckpoint monitoring a validation metric, EarlyStopping and LearningRateMonitor run under pp=2 x dp=2:
    validation goes through the pipeline, the metric reaches every rank, top-k checkpoints are saved and pruned."""
    result = pipeline_groups(4).get("pp2-dp2-callbacks")
    assert len(result["losses"]) == 6
    metrics = result["callback_metrics"]
    assert "val_loss" in metrics and 0 < metrics["val_loss"] < 10, metrics
    # rank 0 holds the first stage: its train_loss came from the last stage (as one tensor after the first step)
    assert metrics["train_loss"] == pytest.approx(result["losses"][-1], rel=1e-6), metrics
    # validation at steps 3 and 6; save_top_k=1 keeps one monitored checkpoint, plus last.ckpt
    assert "last.ckpt" in result["checkpoints"] and len(result["checkpoints"]) == 2, result["checkpoints"]
    assert len(result["val_history"]) == 2, result["val_history"]
    best = next(name for name in result["checkpoints"] if name != "last.ckpt")
    assert f"val_loss={min(result['val_history']):.4f}" in best, (best, result["val_history"])
    assert any(column.startswith("lr-") for column in result["logged_columns"]), result["logged_columns"]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("error-too-many-stages", r"2 stages, but the model has only 1 blocks"),
        ("error-batch-not-divisible", r"batch size \(4\) is not divisible by `num_microbatches=3`"),
        ("error-virtual-not-dividing", r"makes 4 virtual stages, which do not divide the model's 6 blocks"),
        ("error-profile-no-example", r"pipeline_partition='profile'` times the network on an example input"),
        (
            "error-pipeline-network",
            r"pipeline_network='nonexistent'` names no submodule of NanoGPT.*one of \['model'\]",
        ),
    ],
)
def test_bad_pipeline_configuration_raises_on_every_rank(pipeline_groups, name: str, match: str) -> None:
    group = pipeline_groups(2)
    messages = group.expected_errors(name)
    assert len(messages) == 2, f"expected the error on both ranks, got {messages}\n{group.log[-3000:]}"
    for message in messages:
        assert message.startswith("HybridConfigError") and re.search(match, message), message


@pytest.mark.timeout(2400)
def test_tied_copies_laid_out_differently_are_refused_at_set_up(pipeline_groups) -> None:
    """tp=2 x pp=2 with a tied head that tensor parallel leaves whole while the embedding is split: summing the two
    copies' gradients used to crash the gloo all-reduce (``gloo::EnforceNotMet``, "Connection reset by peer" on the
    other ranks); now every rank refuses it at set-up, naming both copies and their layouts."""
    group = pipeline_groups(4)
    messages = group.expected_errors("error-tied-layouts-differ")
    assert len(messages) == 4, f"expected the error on all 4 ranks, got {messages}\n{group.log[-3000:]}"
    assert len(set(messages)) == 1, messages
    pattern = (
        r"HybridConfigError: Under pipeline parallel.*'model\.wte\.weight': pipeline rank 0 holds model\.wte\.weight"
        r" as \(64, 32\) torch\.float32 \(Shard\(dim=0\),\); pipeline rank 1 holds model\.lm_head\.weight as"
        r" \(128, 32\) torch\.float32 plain"
    )
    assert re.search(pattern, messages[0]), messages[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"pipeline_parallel_size": 4, "num_microbatches": 2},
            r"num_microbatches=2` is smaller than `pipeline_parallel_size=4",
        ),
        ({"pipeline_schedule": "zigzag"}, r"pipeline_schedule='zigzag'` is not one of"),
        ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"}, r"set `virtual_pipeline_size` >= 2"),
        ({"pipeline_parallel_size": 2, "virtual_pipeline_size": 2}, r"needs an interleaved schedule"),
        ({"pipeline_parallel_size": 2, "num_microbatches": 0}, r"`num_microbatches` must be a positive integer"),
    ],
)
def test_bad_pipeline_arguments_raise_in_constructor(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(HybridConfigError, match=match):
        HybridStrategy(**kwargs)


def test_partition_by_parameters_gives_the_heavy_head_fewer_blocks() -> None:
    # 8 equal blocks, a head worth 3 blocks on the last stage: "uniform" ignores it, "parameters" balances it
    uniform = partition_blocks(8, 2, partition="uniform", block_costs=[1.0] * 8, last_cost=3.0)
    balanced = partition_blocks(8, 2, partition="parameters", block_costs=[1.0] * 8, last_cost=3.0)
    assert uniform.counts == (4, 4)
    assert balanced.counts[1] < balanced.counts[0], balanced.counts
    assert "stage" in balanced.format_table() and balanced.costs[0] >= 4.0


def test_explicit_partition_and_errors() -> None:
    assert partition_blocks(25, 4, partition=[7, 7, 7, 4]).counts == (7, 7, 7, 4)
    with pytest.raises(HybridConfigError, match=r"must give 4 positive block counts"):
        partition_blocks(25, 4, partition=[7, 7, 7])
    assert partition_blocks(4, 2, 2, "uniform", owner_style="v").owner == (0, 1, 1, 0)


class _HeavyHeadNet(__import__("torch").nn.Module):
    """A transformer-shaped network whose output head costs several blocks (parameters and time)."""

    def __init__(self, blocks: int = 8, width: int = 64, vocab: int = 64) -> None:
        from torch import nn

        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))
        self.head = nn.Sequential(
            nn.Linear(width, 8 * width), nn.GELU(), nn.Linear(8 * width, 8 * width), nn.Linear(8 * width, vocab)
        )

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("mode", ["parameters", "profile"])
def test_stage_table_gives_the_heavy_head_stage_fewer_blocks(mode: str) -> None:
    import torch

    from lightning_hybrid.pipeline.profile import stage_costs

    torch.manual_seed(0)
    net = _HeavyHeadNet()
    example = torch.randint(0, 64, (8, 64))
    costs, first, last = stage_costs(net, "blocks", mode, example)
    plan = partition_blocks(len(costs), 2, partition=mode, block_costs=costs, first_cost=first, last_cost=last)
    params = plan.stage_sums(*stage_costs(net, "blocks", "parameters"))
    table = plan.format_table(params, plan.costs if mode == "profile" else ())
    # every stage's parameters in the table, the head's stage's too (printed at start whatever the partition)
    assert [int(line.split()[-2 if mode == "profile" else -1].replace(",", "")) for line in table.splitlines()[1:]] == [
        round(p) for p in params
    ], table
    assert sum(params) == sum(p.numel() for p in net.parameters())
    assert plan.counts[-1] < plan.counts[0], f"{mode}: the head's stage should hold fewer blocks\n{table}"
    assert sum(plan.counts) == 8


def test_logged_values_travel_as_one_tensor_and_fall_back_when_the_names_change(tmp_path, monkeypatch) -> None:
    """In one process (a one-stage pipeline, no launch): the first step sends the logged records as objects and
    caches their names; later steps send [flag, loss, values] as one tensor; a step that logs a new name, or a value
    that is not a number, goes back to the objects for that step. Every path logs the micro-batch means."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from examples.nanogpt import NanoGPT
    from lightning_hybrid.pipeline import PipelineRunner, split_network

    class Logging(NanoGPT):
        logs = "a"

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self._loss(batch)
            self.log("a", loss, sync_dist=True)
            if "b" in self.logs:
                self.log("b", batch[0].float().mean(), prog_bar=True)
            if "c" in self.logs:
                self.log("c", "not a number")
            return loss

    object_sends = []
    send = dist.broadcast_object_list
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: (object_sends.append(1), send(*a, **k))[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = Logging(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
        logged: list[tuple[str, Any, tuple, dict]] = []
        module.log = lambda name, value, *args, **kwargs: logged.append((name, value, args, kwargs))
        split = split_network(module.model, "h", partition_blocks(2, 1), 0)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pipeline",))
        runner = PipelineRunner(module, module.model, split, mesh["pipeline"], torch.device("cpu"),
                                schedule="1f1b", num_microbatches=2, activation_shape=lambda s: s)  # fmt: skip
        x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
        # (names logged, object broadcast expected)
        steps = [("a", True), ("a", False), ("ab", True), ("ab", False), ("abc", True), ("ab", True), ("ab", False)]
        for i, (names, by_objects) in enumerate(steps):
            module.logs, logged[:], object_sends[:] = names, [], []
            loss = runner.run("training_step", (x, y), i).log(module.log)
            runner.restore_gradients()
            assert bool(object_sends) == by_objects, (i, names)
            assert [r[0] for r in logged] == list(names), logged
            values = {name: value for name, value, _, _ in logged}
            assert loss.dtype == torch.float32 and float(values["a"]) == pytest.approx(float(loss), rel=1e-6)
            if "b" in names:
                assert float(values["b"]) == pytest.approx(float(x.float().mean()), rel=1e-6)
                assert logged[1][3] == {"prog_bar": True}
            if "c" in names:
                assert values["c"] == "not a number"
            assert logged[0][3] == {"sync_dist": True}
            if not by_objects:  # tensors as LightningModule.log would make of the floats
                assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in values.values())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "error-late-norm-pp2",
            r"pipeline stage 0 holds 1 parameter\(s\) that got no gradient at the first step: `ln_f\.weight`.*"
            r"pipeline stage 1 \(the last\): the loss does not depend on the activation received from stage 0.*"
            r"pipeline stage 1: the forward called \['ln_f'\] after the stage's first block",
        ),
        (
            "error-positions-again-pp2",
            r"the cut \[2, 2\] of `h` separates values the forward passes outside the hidden state from where they are"
            r" read: the network's output \(stage 1\) is computed from the output of `wpe` \(an input module",
        ),
        (
            "error-scaled-between-pp2",
            r"`verify_pipeline`: the pipelined network does not match an unsplit forward.*value .* gradient"
            r" norm .*tolerance 0\.0001",
        ),
    ],
)
def test_a_forward_that_does_not_fit_the_cut_is_refused_before_any_step(pipeline_groups, name: str, match: str) -> None:
    """A module registered before the block list but called after it (the first stage holds it, the last ran a zero
    stand-in); an input module's output read again after the blocks (every check of the first step passed, and only
    the unsplit comparison saw it, until the trace's connections across the cut); a hidden state scaled by the
    forward between two blocks, where a stage ends (the next stage takes the block's output unscaled: only the
    unsplit comparison sees it). All trained wrong without a word before; now every rank raises the same error."""
    group = pipeline_groups(2)
    messages = group.expected_errors(name)
    assert len(messages) == 2 and len(set(messages)) == 1, f"{messages}\n{group.log[-3000:]}"
    assert messages[0].startswith("HybridConfigError") and re.search(match, messages[0]), messages[0]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    ("world", "name"),
    [(2, "pp2-1f1b"), (2, "pp2-tied"), (4, "pp2-dp2-zero3-per_step-m2"), (4, "llama-pp2-tp2"),
     (4, "posemb-pp2-dp2-zero3"), (8, "tp2-pp2-dp2-zero3")]
    + [(2, s["name"]) for s in FOREIGN],
)  # fmt: skip
def test_verify_pipeline_ran_once_and_agrees_with_the_unsplit_forward(pipeline_groups, world: int, name: str) -> None:
    """verify_pipeline='auto' (the default) compared the first micro-batch on exactly one rank (the last stage's, in
    the first replica), and the pipelined loss and gradient norm equal the unsplit ones far inside its tolerance."""
    result = pipeline_groups(world).get(name)
    compared = [r["verification"] for r in result["per_rank"] if r["verification"] is not None]
    assert len(compared) == 1, result["per_rank"]
    v = compared[0]
    assert abs(v["loss"] - v["reference_loss"]) <= 1e-5 * abs(v["reference_loss"]), v
    assert abs(v["norm"] - v["reference_norm"]) <= 1e-5 * v["reference_norm"], v


def test_verify_pipeline_takes_true_false_or_auto() -> None:
    with pytest.raises(HybridConfigError, match=r"`verify_pipeline` must be True, False or 'auto', got 'yes'"):
        HybridStrategy(pipeline_parallel_size=2, verify_pipeline="yes")
    HybridStrategy(pipeline_parallel_size=2, verify_pipeline=False)


def test_the_strategys_stops_pass_through_a_users_except_exception() -> None:
    """In one process, the three stops a user's `try/except Exception` once caught: the capture of the network's
    inputs, a stage's forward ending after its last block, and the tensor-parallel trace ending after the first
    block (the multi-process `wrapped-forward-*` scenarios train through them)."""
    import torch
    from torch import nn

    from lightning_hybrid._hooks import capture_call
    from lightning_hybrid.pipeline.stage import StageBoundary
    from lightning_hybrid.tensor_parallel.discover import discover_block_plan

    def guarded(call: Any) -> Any:
        try:
            return call()
        except Exception as error:
            raise RuntimeError("the user's own error") from error

    net = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    assert capture_call(net, lambda: guarded(lambda: net(x))) == ((x,), {})

    def stop(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        raise StageBoundary(output)

    handle = net.register_forward_hook(stop)
    with pytest.raises(StageBoundary):
        guarded(lambda: net(x))
    handle.remove()

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return guarded(lambda: self.blocks[0](x))

    assert discover_block_plan(Root(), "blocks.0", torch.zeros(2, 4)).styles == {"0": "colwise", "2": "rowwise"}


def test_the_action_timer_runs_the_step_callback_as_the_last_action_starts() -> None:
    """The first stage's rank posts its receive of the step's results as its last action starts (gloo): the timer
    counts the actions the schedule starts and calls back once, at the last; a step without a callback, or with
    more actions than counted, calls nothing more."""
    from lightning_hybrid.pipeline.step_data import ActionTimer

    calls: list[int] = []
    timer = ActionTimer(rank=0)
    timer.begin((3, lambda: calls.append(len(timer.timeline.events))))
    for chunk in range(5):
        timer.starting()
        timer.record("F", 0, chunk, timer.start)
    assert calls == [2]  # before the third action recorded, and once
    timer.begin()
    for _ in range(3):
        timer.starting()
    assert calls == [2]
