"""Expert parallel: MoE families written by others (transformers, built from tiny configs) train with their experts
split over the expert-parallel ranks like one device of the same module, data and seed (fp32, 1e-5 relative), each
rank holding the dense weights and 1/ep of the expert weights (measured); what cannot be dispatched is refused
before training, on every rank.

The 2-, 4- and 8-process layouts run in the session's shared launches. Few steps on tiny models: a token sent to the
wrong expert, a weight not multiplied, or an expert gradient averaged over the wrong ranks moves the first step's
loss or gradients by far more than 1e-5.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.expert_parallel import find_expert_modules
from lightning_hybrid.layout import LayoutRequest
from tests.conftest import relative_error, share
from tests.harness import build_module, check_trained_or_refused, run_reference

STEPS = 3
BATCH = 4


def _case(name: str, model: str, world: int, dp: int, refusal: str | None = None, **strategy: Any) -> dict[str, Any]:
    return {"name": f"ep-{name}", "model": model, "model_kwargs": {}, "dataset": "tokens", "steps": STEPS,
            "batch_size": BATCH, "data_parallel_size": dp, "world": world, "refusal": refusal,
            "strategy": {"zero_stage": 0, **strategy}, **({"expect_error": True} if refusal else {})}  # fmt: skip


CASES = [
    # every rank its own data and two of the four experts
    _case("mixtral-ep2", "hf-mixtral", 2, 2, expert_parallel_size=2),
    # one expert per rank over four ranks of data; ZeRO-1 shards the dense weights' optimizer state over all four,
    # each expert's over the ranks holding it (here only itself)
    _case("mixtral-ep4-zero1", "hf-mixtral", 4, 4, expert_parallel_size=4, zero_stage=1),
    # experts over pairs of ranks, each pair's experts reduced over the other pair (expert data parallel), their
    # optimizer state (ZeRO-1) or weights too (ZeRO-3, FSDP2 over the pair) sharded over it
    _case("qwen3_moe-ep2-dp4-zero1", "hf-qwen3_moe", 4, 4, expert_parallel_size=2, zero_stage=1),
    _case("qwen3_moe-ep2-dp4-zero3", "hf-qwen3_moe", 4, 4, expert_parallel_size=2, zero_stage=3),
    _case("mixtral-ep2-dp4-zero2", "hf-mixtral", 4, 4, expert_parallel_size=2, zero_stage=2),
    # one expert per rank over four ranks, each expert held by two (dp8): reduced over the pair, its optimizer state
    # (ZeRO-1) or its weights (ZeRO-3) sharded over it
    _case("mixtral-ep4-dp8-zero1", "hf-mixtral", 8, 8, expert_parallel_size=4, zero_stage=1),
    _case("qwen3_moe-ep4-dp8-zero3", "hf-qwen3_moe", 8, 8, expert_parallel_size=4, zero_stage=3),
    # clipping by the global norm (every step clips): each expert element counted once, whether its shard is held
    # whole by the dp / ep ranks holding it (ZeRO-0) or sharded over them (ZeRO-1)
    *[{**_case(f"mixtral-ep2-dp4-zero{z}-clip", "hf-mixtral", 4, 4, expert_parallel_size=2, zero_stage=z),
       "trainer": {"gradient_clip_val": 1e-3}} for z in (0, 1)],
    # with tensor parallel: the attention split over two ranks, the experts whole on each of them, split over the
    # two data-parallel ranks (the model's own `moe_tp_experts` plan entries give way)
    _case("mixtral-ep2-tp2-zero1", "hf-mixtral", 4, 2, expert_parallel_size=2, tensor_parallel_size=2, zero_stage=1),
    _case("qwen3_moe-ep2-tp2-zero3", "hf-qwen3_moe", 4, 2, expert_parallel_size=2, tensor_parallel_size=2,
          zero_stage=3),
    # a pipeline of two stages, each stage's experts over its two data-parallel ranks: a shared expert, a dense
    # first layer
    _case("deepseek_v3-ep2-pp2", "hf-deepseek_v3", 4, 2, expert_parallel_size=2, pipeline_parallel_size=2),
    _case("qwen2_moe-ep2-pp2-zero3", "hf-qwen2_moe", 4, 2, expert_parallel_size=2, pipeline_parallel_size=2,
          zero_stage=3),
    # more families, found by structure only (tests/zoo_models.py)
    *[_case(f"{family}-ep2", f"hf-{family}", 2, 2, expert_parallel_size=2, zero_stage=1)
      for family in ("olmoe", "gpt_oss", "granitemoe", "ernie4_5_moe", "glm4_moe")],
    # the example's load-balancing loss reads every layer's router logits from the network's output: under a pipeline
    # the last stage would see only its own layers' (a small difference, in silence: Mixtral's coefficient is 1e-3)
    {**_case("mixtral-aux-loss-pp2-refused", "deferred_mixtral", 4, 2,
             r"HybridConfigError: The pipeline cut .* `router_logits` hold values made inside the blocks",
             expert_parallel_size=2, pipeline_parallel_size=2),
     "model_kwargs": {"num_hidden_layers": 2, "num_local_experts": 4, "hidden_size": 32, "intermediate_size": 64,
                      "router_aux_loss_coef": 1e-3}},
    # no mixture-of-experts layer: refused, not trained as if split
    _case("llama-refused", "hf-llama", 2, 2,
          r"HybridConfigError: `expert_parallel_size=2`, but .* has no mixture-of-experts", expert_parallel_size=2),
]  # fmt: skip
# checkpoints: saved at ep2 (dp4, ZeRO-1) after steps 2 and 4 of 4, mid-epoch; resumed from step 2 at ep4 (ZeRO-1)
# and without expert parallel (ZeRO-3); the run after loading must be the saving run's
SAVE_AT, SAVED_STEPS = 2, 4
SAVER = {"kind": "ModelCheckpoint", "every_n_train_steps": SAVE_AT, "save_top_k": -1}
SOURCE = {**_case("mixtral-ep2-dp4-saves", "hf-mixtral", 4, 4, expert_parallel_size=2, zero_stage=1),
          "steps": SAVED_STEPS, "callbacks": [SAVER]}  # fmt: skip
SAVED = f"{SOURCE['name']}/*step={SAVE_AT}.ckpt"
RESUMED = [
    {**_case(f"mixtral-resumed-at-{name}", "hf-mixtral", 4, 4, **strategy), "steps": SAVED_STEPS, "resume_from": SAVED}
    for name, strategy in [("ep4", {"expert_parallel_size": 4, "zero_stage": 1}), ("ep1-zero3", {"zero_stage": 3})]
]
# low precision: the same layout with the experts split (ep2) and replicated (ep1), each under the precision plugin
# (fp16 with its loss scaler, bf16 autocast, bf16 weights with fp32 masters): the split may only change the experts'
# low-precision rounding
MIXED = [
    {**_case(f"mixtral-ep{ep}-dp4-zero1-{precision}", "hf-mixtral", 4, 4, expert_parallel_size=ep, zero_stage=1),
     "precision_plugin": {"precision": precision}, "probe": True}
    for precision in ("16-mixed", "bf16-mixed", "bf16-true") for ep in (1, 2)
]  # fmt: skip
for _world in (2, 4, 8):
    share(_world, [c for c in CASES if c["world"] == _world] + ([SOURCE, *RESUMED, *MIXED] if _world == 4 else []))


def _expert_and_dense_numel(model: str) -> tuple[int, int]:
    module = build_module(model)
    experts, _ = find_expert_modules(module)
    expert = sum(p.numel() for e in experts for p in module.get_submodule(e.name).parameters())
    return expert, sum(p.numel() for p in module.parameters()) - expert


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_expert_parallel_matches_one_device_or_is_refused(shared_groups, case: dict[str, Any]) -> None:
    world = case["world"]
    group = shared_groups(world)
    check_trained_or_refused(group, case, world)
    if "gradient_clip_val" in case.get("trainer", {}):
        # the global norm that clipping used, step by step, is one device's: each expert element counted once
        reference = run_reference({k: v for k, v in case.items() if k not in ("strategy", "refusal")})
        got, want = group.get(case["name"])["norms"], reference["norms"]
        assert len(got) == len(want) == STEPS, (got, want)
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want)), (got, want)
    if case["refusal"] or any(case["strategy"].get(f"{d}_parallel_size", 1) > 1 for d in ("pipeline", "tensor")):
        return  # the dense weights are split further: counted in the tp = pp = 1 cases
    # measured: each rank holds every dense weight and 1/ep of the expert weights (fp32); under ZeRO-3 both are
    # sharded further, over all data-parallel ranks and over the ranks holding the same experts, and the ranks'
    # shards add up to the model once
    expert, dense = _expert_and_dense_numel(case["model"])
    ep, zero = case["strategy"]["expert_parallel_size"], case["strategy"]["zero_stage"]
    records = group.get(case["name"])["per_rank"]
    held = [record["model_state"]["parameters"] for record in records]
    if zero == 3:
        assert sum(held) == 4 * (dense + expert), held
        return
    assert held == [4 * (dense + expert // ep)] * world, held
    if zero == 0:
        assert [r["model_state"]["gradients"] for r in records] == [4 * (dense + expert // ep)] * world


@functools.cache
def _fp32_reference() -> dict[str, Any]:
    """One device in fp32 on the low-precision cells' module and data: run once for all three precisions."""
    return run_reference({k: v for k, v in MIXED[0].items() if k not in ("strategy", "refusal", "precision_plugin")})


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_low_precision_with_experts_split_trains_as_with_experts_replicated(shared_groups, precision) -> None:
    """Under fp16 (loss scaling, overflow agreed over every rank), bf16 autocast and bf16 weights with fp32 masters,
    splitting the experts changes only the rounding of their low-precision matmuls: losses within 0.5% of the same
    layout with every expert on every rank, and of fp32 on one device within 2%; the loss scale the same on every
    rank."""
    group = shared_groups(4)
    split, replicated = (group.get(f"ep-mixtral-ep{ep}-dp4-zero1-{precision}") for ep in (2, 1))
    fp32 = _fp32_reference()
    assert len(split["losses"]) == len(replicated["losses"]) == len(fp32["losses"]) == STEPS
    for got, same_layout, one_device in zip(split["losses"], replicated["losses"], fp32["losses"]):
        assert abs(got - same_layout) / same_layout <= 5e-3, (split["losses"], replicated["losses"])
        assert abs(got - one_device) / one_device <= 2e-2, (split["losses"], fp32["losses"])
    assert split["losses"] != fp32["losses"], "the plugin must have run in low precision"
    for name, want in replicated["params"].items():
        assert relative_error(split["params"][name], want) <= 5e-2, name
    # every rank used the same loss scale and skipped the same steps (an overflow in one rank's experts skips all)
    per_rank = [[(step["scale"], step["skipped"]) for step in steps] for steps in split["probe"]]
    assert len(per_rank) == 4 and all(r == per_rank[0] for r in per_rank), per_rank


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", RESUMED, ids=[c["name"] for c in RESUMED])
def test_a_checkpoint_saved_at_ep2_resumes_at_another_expert_parallel_size(shared_groups, case) -> None:
    """The expert weights and their optimizer state are saved per parameter, as DTensors over the expert ranks: any
    layout loads them (DCP cuts each for its new owners). Losses after loading and the final weights equal the saving
    run's, within 1e-5."""
    group = shared_groups(4)
    original, resumed = group.get(SOURCE["name"]), group.get(case["name"])
    assert len(resumed["losses"]) == SAVED_STEPS - SAVE_AT, "the resumed run must start at the saved step"
    for step, (got, want) in enumerate(zip(resumed["losses"], original["losses"][SAVE_AT:]), start=SAVE_AT + 1):
        assert abs(got - want) / abs(want) <= 1e-5, f"step {step}: loss {got} after loading, {want} in the original"
    for name, want in original["params"].items():
        assert relative_error(resumed["params"][name], want) <= 1e-5, name


@pytest.mark.timeout(2400)
def test_an_expert_parallel_checkpoint_consolidates_to_the_models_own_layout(shared_groups, tmp_path) -> None:
    """Consolidated without any process group, the ep2 checkpoint holds each packed expert tensor whole, as the
    model defines it, equal to the weights gathered from the ranks, and loads strictly into the one-device module."""
    from safetensors.torch import load_file

    from lightning_hybrid.checkpoint import consolidate

    group = shared_groups(4)
    checkpoint = next(group.out_dir.glob(f"{SOURCE['name']}/*step={SAVED_STEPS}.ckpt"))
    weights = load_file(consolidate(checkpoint, tmp_path) / "model.safetensors")
    # the transformers model's own names (the LightningModule holds it as `model`)
    gathered = {name.removeprefix("model."): p for name, p in group.get(SOURCE["name"])["params"].items()}
    assert gathered.keys() == weights.keys()
    for name, want in gathered.items():
        assert torch.equal(weights[name], want), name
    build_module("hf-mixtral").model.load_state_dict(weights, strict=True)


# ---------------------------------------------------------------------------------------------- single process
class _ListedMoE(nn.Module):
    """A user's MoE block that loops over a list of expert modules in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        return sum(torch.where((choice == i)[:, None], e(x), 0) for i, e in enumerate(self.experts))


def test_experts_are_found_by_structure_and_a_routing_loop_of_the_block_is_named() -> None:
    found, refused = find_expert_modules(build_module("hf-mixtral"))
    assert [(e.name, e.num_experts) for e in found] == [(f"model.model.layers.{i}.mlp.experts", 4) for i in (0, 1)]
    assert refused == {}
    found, refused = find_expert_modules(nn.Sequential(_ListedMoE()))
    assert found == [] and list(refused) == ["0.experts"]
    assert "calls in its own loop" in refused["0.experts"]


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ({"expert_parallel_size": 3}, r"`expert_parallel_size=3` must divide the data-parallel size \(4\)"),
        ({"expert_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 2, "sequence_parallel": True},
         r"does not run with `sequence_parallel=True` yet"),
        ({"expert_parallel_size": 0}, r"expert_parallel_size"),
    ],
)  # fmt: skip
def test_expert_parallel_layouts_it_cannot_run_are_refused_before_any_process_group(sizes, words) -> None:
    with pytest.raises(HybridConfigError, match=words):
        LayoutRequest(**sizes).resolve(4)
