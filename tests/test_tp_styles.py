"""Every tensor-parallel style name transformers 5 declares is translated into torch's styles or refused with the
style named; models whose declared plans use them train at tp=2 like one device (fp32, 1e-5)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.structure import find_model_structure
from lightning_hybrid.tensor_parallel import build_tensor_parallel_plan
from lightning_hybrid.tensor_parallel.styles import KNOWN_STYLES, REFUSED_STYLES, parameter_placement, style_from_name
from tests.conftest import relative_error, share
from tests.harness import run_reference

STEPS = 10
TOL = 1e-5


def scenario(family: str, strategy: dict[str, Any], **extra: Any) -> dict[str, Any]:
    name = f"hf-{family}-" + "-".join(f"{k.split('_')[0]}{v}" for k, v in strategy.items())
    return {"name": name, "model": f"hf-{family}", "model_kwargs": {}, "strategy": strategy, "steps": STEPS,
            "batch_size": 4, "data_parallel_size": 1, **extra}  # fmt: skip


PARITY = [scenario(family, {"tensor_parallel_size": 2}) for family in ("phi3", "mixtral", "qwen3", "gpt_neox")]
share(2, PARITY)


@pytest.fixture(scope="session")
def group2(shared_groups):
    return shared_groups(2)


@functools.cache
def _reference(model: str) -> dict[str, Any]:
    return run_reference({**PARITY[0], "model": model})


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", PARITY, ids=[s["name"] for s in PARITY])
def test_declared_hugging_face_plans_train_like_one_device(group2, case: dict[str, Any]) -> None:
    result, reference = group2.get(case["name"]), _reference(case["model"])
    assert result["layout"]["tensor_parallel_size"] == 2
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} vs one device {want}"
    for kind in ("params", "grads"):
        assert result[kind].keys() == reference[kind].keys()
        for name, want in reference[kind].items():
            err = relative_error(result[kind][name], want)
            assert err <= TOL, f"{kind} {name}: relative error {err:.2e}"
    # the plan really split the blocks: each rank holds less than the whole model
    total = sum(p.numel() for p in reference["params"].values())
    assert all(record["local_numel"] < total for record in result["per_rank"])


# ------------------------------------------------------------------------------------------------ single process
def test_every_style_transformers_registers_is_translated_or_refused() -> None:
    """The list is read from transformers' own registry, so a style a new release adds fails here until handled."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    registered = set(ALL_PARALLEL_STYLES.valid_keys())
    assert registered, "transformers registered no tensor-parallel style"
    assert registered - KNOWN_STYLES == set()
    for style in sorted(registered):
        target = nn.Embedding(8, 4) if style.startswith("embedding") else nn.Linear(4, 4)
        try:
            translated = style_from_name(style, "layer", target)
        except HybridConfigError as error:  # a refusal names the style and says why
            assert style in REFUSED_STYLES or style == "packed_rowwise", (style, error)
            assert repr(style) in str(error), str(error)
            continue
        assert style not in REFUSED_STYLES, style
        assert translated is None or translated.__class__.__name__, style


def test_parameter_entries_shard_expert_weights_as_transformers_does() -> None:
    from torch.distributed.tensor import Replicate, Shard

    gate_up, down = torch.empty(4, 16, 8), torch.empty(4, 8, 8)
    packed = parameter_placement("packed_colwise", "experts.gate_up_proj", gate_up)
    assert (packed.dim, packed.split_factor) == (1, 2)  # each of gate|up split on its own
    assert parameter_placement("rowwise", "experts.down_proj", down) == Shard(2)
    assert parameter_placement("rowwise", "bias", torch.empty(8)) == Replicate()
    with pytest.raises(HybridConfigError, match=r"parameter 'w' the style 'colwise_gather_output'"):
        parameter_placement("colwise_gather_output", "w", down)


def _hf(family: str) -> nn.Module:
    from tests.zoo_models import HFCausalLM

    return HFCausalLM(family)


def test_plans_with_splits_closed_within_a_layer_open_no_region() -> None:
    """Phi-3 gathers its fused qkv and gate|up outputs and slices o_proj/down_proj inputs: no head count changes."""
    module = _hf("phi3")
    plan = build_tensor_parallel_plan(module, find_model_structure(module))
    assert plan.sharded_region_modules == set() and plan.attention_modules == set()
    style = plan.styles["model.model.layers.0.self_attn.o_proj"]
    assert type(style).__name__ == "RowwiseParallel" and style.input_layouts[0].is_replicate()


def test_expert_weights_without_a_local_module_style_are_refused() -> None:
    module = _hf("mixtral")
    structure = find_model_structure(module)
    plan = dict(module.model._tp_plan)
    plan.pop("model.layers.*.mlp.experts")
    plan = {f"model.{k}": v for k, v in plan.items()}
    with pytest.raises(HybridConfigError, match=r"shards parameters of 'model.model.layers.0.mlp.experts'.*moe_tp_exp"):
        build_tensor_parallel_plan(module, structure, plan)
    with pytest.raises(HybridConfigError, match=r"style 'grouped_gemm': it is an expert-parallel style"):
        build_tensor_parallel_plan(module, structure, {"model.model.layers.*.mlp.experts": "grouped_gemm"})


def test_qwen3_norms_between_the_splits_have_their_gradients_summed() -> None:
    module = _hf("qwen3")
    plan = build_tensor_parallel_plan(module, find_model_structure(module))
    assert "model.model.layers.1.self_attn.q_norm" in plan.gradient_sum_modules
