"""Model-structure discovery and plan checks that once went wrong (single process)."""

from __future__ import annotations

import pytest

from lightning_hybrid import HybridConfigError, HybridStrategy
from lightning_hybrid.structure import find_model_structure
from lightning_hybrid.tensor_parallel import build_tensor_parallel_plan, validate_tensor_parallel_plan


def test_token_embedding_is_the_one_the_head_predicts_not_the_largest() -> None:
    from examples.nanogpt import NanoGPT

    model = NanoGPT(vocab_size=64, block_size=256, n_layer=1)  # the position table is larger than the vocabulary
    structure = find_model_structure(model)
    assert structure.token_embedding_name == "model.wte"
    assert structure.output_head_name == "model.lm_head"


def test_dict_plan_naming_embedding_and_head_opens_no_split_region() -> None:
    from examples.nanogpt import NanoGPT

    model = NanoGPT(vocab_size=64, n_layer=2)
    structure = find_model_structure(model)
    plan = build_tensor_parallel_plan(model, structure, {
        "model.wte": "embedding_rowwise", "model.lm_head": "colwise_rep",
        "model.h.*.mlp.c_fc": "colwise", "model.h.*.mlp.c_proj": "rowwise"})  # fmt: skip
    # only the MLPs are split regions: norms outside them keep averaged (not summed) gradients
    assert plan.sharded_region_modules == {"model.h.0.mlp", "model.h.1.mlp"}


def test_hugging_face_key_value_heads_must_divide() -> None:
    from examples.hf_llama import HFLlama

    model = HFLlama(num_attention_heads=4, num_key_value_heads=1, hidden_size=32, num_hidden_layers=1)
    structure = find_model_structure(model)
    plan = build_tensor_parallel_plan(model, structure)
    with pytest.raises(HybridConfigError, match=r"config.num_key_value_heads=1"):
        validate_tensor_parallel_plan(model, plan, 2)


@pytest.mark.parametrize("stage", [1.0, True, "1"])
def test_zero_stage_must_be_an_int(stage: object) -> None:
    with pytest.raises(HybridConfigError, match="zero_stage"):
        HybridStrategy(zero_stage=stage)  # type: ignore[arg-type]
