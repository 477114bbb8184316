"""Issue: the memory ledger and layout planner. The seeds' figures out of `lightning-hybrid plan`, the decision rules
and worked cases, model state predicted to the byte against what the strategy measures (scenarios of the shared
launches), activations within 10% of what autograd saves, and `layout="auto"` training on 8 processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

# the scenarios whose measured model state is predicted below are registered by their own modules (all launched once)
import tests.test_checkpoint  # noqa: F401
import tests.test_pipeline  # noqa: F401
import tests.test_precision  # noqa: F401
from lightning_hybrid import HybridConfigError, HybridStrategy, plan
from lightning_hybrid.planning import GB, ModelSpec, predict_model_state_bytes, state_bytes_per_parameter
from lightning_hybrid.planning.activations import block_bytes, stage_activation_bytes
from lightning_hybrid.planning.auto import auto_layout
from tests.conftest import SHARED, assert_clean_exit, console_script, share
from tests.harness import build_module
from tests.test_foundation import assert_parity, reference_for, scenario

# LLaMA-7B as the seeds count it: 6.7e9 parameters, s=2048, b=4, h=4096, a=32, 32 layers, GPT-style MLP of 4h
LLAMA7B = ["--params", "6.7e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
           "--seq", "2048", "--micro-batch", "4", "--optimizer", "adam"]  # fmt: skip
CLUSTER = {"devices_per_node": 8, "nodes": 4, "device_memory": 80}
LLAMA13B = {"params": 13e9, "layers": 40, "hidden": 5120, "heads": 40, "ffn": 13824, "vocab": 32000, "seq": 2048}
LLAMA65B = {"params": 65e9, "layers": 80, "hidden": 8192, "heads": 64, "ffn": 22016, "vocab": 32000, "seq": 2048}


def _plan_json(*args: str) -> list[dict[str, Any]]:
    proc = console_script("plan", *args, "--json", timeout=300)
    assert_clean_exit(proc)
    return json.loads(proc.stdout)["layouts"]


def _find(layouts: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [x for x in layouts if all(x[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


@pytest.fixture(scope="module")
def png(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("plan") / "plan.png"


@pytest.fixture(scope="module")
def llama7b_on_8(png) -> list[dict[str, Any]]:
    """The one run of the command (importing the package is what costs): LLaMA-7B, bf16 (2-byte parameters and
    gradients), Adam, data parallel over 8, with its PNG."""
    return _plan_json(*LLAMA7B, "--precision", "bf16", "--devices-per-node", "8", "--nodes", "1",
                      "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--png", str(png))  # fmt: skip


def test_png_of_stacked_bars(llama7b_on_8, png) -> None:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_json_schema_best_first(llama7b_on_8) -> None:
    keys = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "zero_stage", "num_microbatches",
            "recompute", "feasible", "reason", "step_time_s", "ledger", "expert_parallel_size",
            "step_terms_s"}  # fmt: skip
    ledger = {"parameters", "gradients", "master", "optimizer", "activations", "buffers", "setup", "peak"}
    terms = {"compute", "bubble", "tensor", "data", "pipeline", "all_to_all", "total"}
    for layout in llama7b_on_8:
        assert set(layout) == keys and set(layout["ledger"]) == ledger
        assert layout["expert_parallel_size"] == 1, "a dense model is planned without expert parallel"
        assert set(layout["step_terms_s"]) == terms and layout["step_terms_s"]["all_to_all"] == 0
        assert layout["step_terms_s"]["total"] == pytest.approx(layout["step_time_s"])
        # the peak is the larger of training (every term) and set-up (shards + the replay's largest tensors)
        training = sum(v for k, v in layout["ledger"].items() if k not in ("peak", "setup"))
        assert layout["ledger"]["peak"] == pytest.approx(max(training, layout["ledger"]["setup"]))
    feasible = [x["feasible"] for x in llama7b_on_8]
    assert feasible == sorted(feasible, reverse=True), "feasible layouts first"
    times = [
        x["step_time_s"] / (x["data_parallel_size"] * x["num_microbatches"]) for x in llama7b_on_8 if x["feasible"]
    ]
    assert times == sorted(times), "feasible layouts ranked by estimated time per token"
    worst = next(x for x in llama7b_on_8 if not x["feasible"])
    assert " + " in worst["reason"] and worst["reason"].endswith("> 80 GB x 0.9"), worst["reason"]


def test_seed_llama7b_model_state_107_gb_and_zero_stages(llama7b_on_8) -> None:
    def state(zero: int) -> dict[str, float]:
        ledger = _find(llama7b_on_8, zero_stage=zero, recompute="none")["ledger"]
        return {k: ledger[k] / GB for k in ("parameters", "gradients", "master", "optimizer")}

    replicated = state(0)  # what one device holds: 13.4 + 13.4 + 80.4 = 107 GB before activations
    assert replicated["parameters"] == pytest.approx(13.4) and replicated["gradients"] == pytest.approx(13.4)
    assert replicated["master"] + replicated["optimizer"] == pytest.approx(80.4)
    assert sum(replicated.values()) == pytest.approx(107.2)
    for zero, want in ((1, 37), (2, 25), (3, 13)):  # on 8 devices
        assert round(sum(state(zero).values())) == want, (zero, state(zero))


def test_seed_llama7b_activations_122_36_5_and_2_gb(llama7b_on_8) -> None:
    spec = ModelSpec(layers=32, hidden=4096, heads=32, seq=2048, vocab=32000)
    # Korthikanti et al. per layer: s b h (34 + 5 a s / h) bytes; selective recompute keeps 34 s b h; full keeps 2 s b h
    per_layer = {r: block_bytes(spec, 4, recompute=r, attention="eager", dropout=True) for r in ("none", "selective",
                                                                                                 "full")}  # fmt: skip
    sbh = 2048 * 4 * 4096
    assert per_layer["none"] == sbh * (34 + 5 * 32 * 2048 / 4096)
    assert per_layer["selective"] == 34 * sbh and per_layer["full"] == 2 * sbh
    assert round(32 * per_layer["none"] / GB) == 122
    assert round(32 * per_layer["selective"] / GB, 1) == 36.5
    assert round(32 * per_layer["full"] / GB) == 2
    # the command's ledger: the blocks plus the final norm's values (0.1 GB; the logits are a buffer)
    for recompute, want in (("none", 122.4), ("selective", 36.5), ("full", 2.1)):
        got = _find(llama7b_on_8, zero_stage=0, recompute=recompute)["ledger"]["activations"] / GB
        assert got == pytest.approx(want, abs=0.2), (recompute, got)


def test_seed_mixed_precision_7_5b_is_120_gb_and_65b_adam_state_is_780_gb() -> None:
    for precision in ("bf16", "bf16-mixed"):  # 16 bytes per parameter either way (2+2+4+8, or 4+4+8)
        per = state_bytes_per_parameter(precision, "adam", 0, 1)
        assert sum(per.values()) * 7.5e9 / GB == pytest.approx(120)
    # one seed counts Adam's fp32 state for 65B as 520 GB (8 bytes per parameter: the two moments only); with the
    # fp32 master it is 12 bytes per parameter: 780 GB
    per = state_bytes_per_parameter("bf16", "adam", 0, 1)
    assert (per["master"] + per["optimizer"]) * 65e9 / GB == pytest.approx(780)
    assert per["optimizer"] * 65e9 / GB == pytest.approx(520)


@pytest.mark.parametrize(("sizes", "name"), [(LLAMA65B, "65B"), (LLAMA13B, "13B")])
def test_worked_cases_reach_tp8_x_pp4(sizes: dict[str, int], name: str) -> None:
    result = plan(**sizes, micro_batch=4, precision="bf16", optimizer="adam", **CLUSTER)
    rule = result.rule.candidate
    assert (rule.tensor_parallel_size, rule.pipeline_parallel_size, rule.data_parallel_size) == (8, 4, 1), rule
    assert rule.num_microbatches == 16 and result.rule.feasible
    assert result.rule_reason.startswith("rule 3"), result.rule_reason
    # the ranking either puts it first or says what it prefers and by how much
    table = result.table()
    assert "<- rule" in table
    if result.best is not result.rule:
        assert f"ranked first: {result.best.candidate.describe()}" in table


def test_decision_rules_data_parallel_then_zero3() -> None:
    small = plan(layers=12, hidden=768, heads=12, vocab=50257, seq=1024, micro_batch=4, precision="bf16", nodes=1)
    assert small.rule_reason.startswith("rule 1") and small.rule.candidate.data_parallel_size == 8
    mid = plan(**LLAMA13B, micro_batch=1, precision="bf16", optimizer="adam", **CLUSTER)
    assert mid.rule_reason.startswith("rule 2"), mid.rule_reason
    c = mid.rule.candidate
    assert (c.tensor_parallel_size, c.pipeline_parallel_size, c.zero_stage) == (1, 1, 3)


def test_model_forms_agree(tmp_path) -> None:
    """A class path built on the meta device, a Hugging Face config as a dict, a file and a folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 64}  # fmt: skip
    real = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())
    (tmp_path / "config.json").write_text(json.dumps(config))
    for form in (config, tmp_path / "config.json", tmp_path):
        assert ModelSpec.from_hf_config(form).total_params == real
    meta = plan("examples.hf_llama.HFLlama", init_args={k: v for k, v in config.items() if k != "model_type"},
                nodes=1, device_memory=1)  # fmt: skip
    assert meta.spec.total_params == real and meta.spec.family == "llama" and meta.spec.kv == 2
    gpt = plan("examples.nanogpt.NanoGPT", init_args={"n_layer": 3}, nodes=1, device_memory=0.001)
    assert "3 layers" in gpt.table() and gpt.spec.family == "gpt" and gpt.spec.position_embeddings == 64


def test_configuration_errors() -> None:
    with pytest.raises(HybridConfigError, match="layout='auto'.*tensor_parallel_size=2"):
        HybridStrategy(layout="auto", tensor_parallel_size=2)
    with pytest.raises(HybridConfigError, match="`layout='manual'`"):
        HybridStrategy(layout="manual")
    with pytest.raises(HybridConfigError, match="device_memory"):
        auto_layout(build_module("nanogpt"), world_size=2, devices_per_node=2, device=torch.device("cpu"),
                    device_memory=None, precision="32-true", activation_checkpointing=False, schedule="1f1b",
                    virtual_stages=1)  # fmt: skip
    with pytest.raises(HybridConfigError, match="precision"):
        plan(layers=2, hidden=64, heads=4, precision="bf17")


# ---------------------------------------------------------------------- activations against saved_tensors_hooks
ACT_MODELS = {
    "nanogpt": {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 64, "bias": False},
    "llama": {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "intermediate_size": 160, "max_position_embeddings": 64},
}  # fmt: skip


def _saved_bytes_per_stage(module: torch.nn.Module, batch: tuple, stages: int, checkpointing: bool) -> list[int]:
    """Bytes autograd keeps for one micro-batch, per pipeline stage: every saved tensor's storage once (parameters
    are not activations). Each stage's share is what the stage's own sub-network saves when run alone: the ops of
    the blocks it holds, the embedding on the first and the final norm, head and loss on the last (forward hooks
    on the blocks mark where a stage begins)."""
    from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing
    from lightning_hybrid.structure import find_model_structure

    structure = find_model_structure(module)
    if checkpointing:
        apply_activation_checkpointing(module, structure.block_names())
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: list[dict[int, int]] = [{} for _ in range(stages)]
    current = [0]
    per_stage = structure.num_blocks // stages
    for i, name in enumerate(structure.block_names()):
        module.get_submodule(name).register_forward_pre_hook(lambda *_, s=i // per_stage: current.__setitem__(0, s))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module._loss(batch)
    return [sum(s.values()) for s in seen]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ac", "ac"])
@pytest.mark.parametrize("stages", [1, 2], ids=["pp1", "pp2"])
@pytest.mark.parametrize("model", sorted(ACT_MODELS))
def test_activations_within_10_percent_of_saved_tensors(model: str, stages: int, checkpointing: bool) -> None:
    module = build_module(model, **ACT_MODELS[model])
    b, s = 4, 64
    x = torch.randint(0, 128, (b, s))
    measured = _saved_bytes_per_stage(module, (x, torch.randint(0, 128, (b, s))), stages, checkpointing)
    spec = ModelSpec.from_module(module, seq=s)
    for stage, got in enumerate(measured):
        parts = stage_activation_bytes(spec, b, spec.layers / stages, first=stage == 0, last=stage == stages - 1,
                                       act_bytes=4, recompute="full" if checkpointing else "none")  # fmt: skip
        want = sum(parts.values())
        assert abs(got - want) <= 0.1 * got, f"stage {stage}: predicted {want} bytes, autograd saved {got}"


# ---------------------------------------------------------------------- model state, to the byte, against the strategy
# scenarios of the shared launches (their modules register them): every ZeRO stage in TP, PP and 3D layouts
STATE_SCENARIOS = {
    2: [f"{m}-dp2-zero{z}" for m in ("nanogpt", "llama") for z in range(4)],
    4: ["nanogpt-tp2-dp2-zero0-clip", "nanogpt-tp2-dp2-zero1", "nanogpt-tp2-dp2-zero2-buckets-accum",
        "nanogpt-tp2-dp2-zero3", "llama-tp2-dp2-zero1", "llama-tp2-dp2-zero3", "pp2-dp2-zero0-m2", "pp2-dp2-zero1-m2",
        "pp2-dp2-zero2-m2", "pp2-dp2-zero3-per_step-m2", "pp2-dp2-zero3-per_microbatch-m2", "llama-pp2-tp2",
        "pp4-interleaved_1f1b"],
    8: ["plan-tp2-pp2-dp2-zero0", "tp2-pp2-dp2-zero1", "tp2-pp2-dp2-zero2", "tp2-pp2-dp2-zero3",
        "state-bf16-true-2x2x2-zero1", "state-bf16-true-tp2-dp4-zero2", "state-bf16-true-tp2-dp4-zero3",
        "mixed-bf16-mixed-2x2x2"],
}  # fmt: skip
ZERO0_3D = scenario("plan-tp2-pp2-dp2-zero0", "nanogpt",
                    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 0}, 2, steps=2)  # fmt: skip

# layout="auto" on 8 processes: a device so small (300 KB) that the planner must split the nanoGPT example
AUTO_MEMORY_GB = 3e-4
AUTO_BATCH = 8


def _auto_plan() -> tuple[dict[str, Any], Any, str]:
    module = build_module("nanogpt", bias=False)
    return auto_layout(module, world_size=8, devices_per_node=8, device=torch.device("cpu"),
                       device_memory=AUTO_MEMORY_GB, precision="32-true", activation_checkpointing=False,
                       schedule="1f1b", virtual_stages=1)  # fmt: skip


AUTO_SIZES, AUTO_MICROBATCHES, AUTO_MESSAGE = _auto_plan()
AUTO = scenario("plan-auto-nanogpt", "nanogpt", {"layout": "auto", "device_memory": AUTO_MEMORY_GB},
                AUTO_SIZES["data_parallel_size"], batch_size=AUTO_BATCH)  # fmt: skip
share(8, [ZERO0_3D, AUTO])


def _registered(world: int, name: str) -> dict[str, Any]:
    return next(s for s in SHARED[world] if s["name"] == name)


STATE_CASES = [(w, n) for w, names in STATE_SCENARIOS.items() for n in names]
_STRATEGY_KEYS = ("tensor_parallel_plan", "vocab_parallel_loss", "transformer_blocks", "pipeline_partition",
                  "virtual_pipeline_size", "pipeline_schedule", "overlap_grad_reduce")  # fmt: skip


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("world", "name"), STATE_CASES, ids=[n for _, n in STATE_CASES])
def test_model_state_predicted_exactly(shared_groups, world: int, name: str) -> None:
    case = _registered(world, name)
    result = shared_groups(world).get(name)
    layout = result["layout"]
    precision = (case.get("precision_plugin") or {}).get("precision") or case.get("trainer", {}).get("precision")
    with torch.device("meta"):
        module = build_module(case["model"], **case.get("model_kwargs", {}))
    predicted = predict_model_state_bytes(
        module,
        tensor_parallel_size=layout["tensor_parallel_size"],
        pipeline_parallel_size=layout["pipeline_parallel_size"],
        data_parallel_size=layout["data_parallel_size"],
        zero_stage=layout["zero_stage"],
        precision=precision or "32-true",
        **{k: v for k, v in case["strategy"].items() if k in _STRATEGY_KEYS},
    )
    measured = [r["model_state"] for r in result["per_rank"]]
    assert predicted == measured


@pytest.mark.timeout(2400)
def test_layout_auto_trains_the_layout_the_planner_printed(shared_groups) -> None:
    result = shared_groups(8).get(AUTO["name"])
    got = {k: result["layout"][k] for k in AUTO_SIZES}
    assert got == AUTO_SIZES
    assert got["tensor_parallel_size"] > 1 and got["pipeline_parallel_size"] > 1, "a 3D layout at 300 KB per device"
    assert AUTO_MESSAGE.splitlines()[0] in shared_groups(8).log, "the strategy logs the planned layout"
    assert_parity(result, reference_for(AUTO))
