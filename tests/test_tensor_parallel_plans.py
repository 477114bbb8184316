"""Tensor-parallel plans for models written by others: every style name transformers 5 declares is translated into
torch's styles or refused with the style named; a model whose layer names tell nothing gets its plan from the data flow
of one forward. That the models using these plans train at tp=2 like one device is the model zoo's (test_zoo.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.structure import find_model_structure
from lightning_hybrid.tensor_parallel import build_tensor_parallel_plan
from lightning_hybrid.tensor_parallel.styles import KNOWN_STYLES, REFUSED_STYLES, parameter_placement, style_from_name

# The models whose declared or discovered plans these tests read (Phi-3, Mixtral, Qwen3, GPT-NeoX, torch's
# nn.TransformerEncoder, litgpt's Pythia- and Llama-style GPT) train at tp=2 against one device in the model zoo
# (tests/test_zoo.py), which also asserts litgpt's grouped-query fused qkv is refused alike on every rank.


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


def test_data_flow_finds_the_plan_names_do_not_tell() -> None:
    from lightning_hybrid.tensor_parallel.discover import discover_block_plan
    from tests.zoo_models import TorchEncoderLM

    module = TorchEncoderLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    found = discover_block_plan(module, "encoder.layers.0", module.example_input_array)
    # MultiheadAttention computes with its weights directly: it stays replicated
    assert found.styles == {"linear1": "colwise", "linear2": "rowwise"}
    assert found.inside_split == ["dropout"]  # the only module between linear1 and linear2: no attention, no norm
    assert torch.equal(rng, torch.get_rng_state())  # the forward leaves no trace
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    plan = build_tensor_parallel_plan(module, find_model_structure(module))
    assert {n for n in plan.styles if n.startswith("encoder")} == {
        f"encoder.layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)
    }


@pytest.mark.parametrize(
    ("mlp", "groups", "expected"),
    [
        ("GptNeoxMLP", 4, {"attn.qkv": "fused_colwise_3", "attn.proj": "rowwise", "mlp.fc": "colwise",
                           "mlp.proj": "rowwise"}),
        ("LLaMAMLP", 4, {"attn.qkv": "fused_colwise_3", "attn.proj": "rowwise", "mlp.fc_1": "colwise",
                         "mlp.fc_2": "colwise", "mlp.proj": "rowwise"}),
    ],
)  # fmt: skip
def test_data_flow_reads_litgpt_blocks(mlp: str, groups: int, expected: dict[str, str]) -> None:
    from litgpt import GPT, Config

    from lightning_hybrid.tensor_parallel.discover import discover_block_plan

    config = Config(block_size=16, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32,
                    bias=False, mlp_class_name=mlp, intermediate_size=64, n_query_groups=groups)  # fmt: skip
    net = GPT(config)
    assert discover_block_plan(net, "transformer.h.0", torch.zeros(1, 8, dtype=torch.long)).styles == expected


def test_grouped_query_fused_qkv_is_refused_not_split_wrong() -> None:
    """litgpt's qkv holds q|k|v of unequal sizes under grouped-query attention: by data flow the split sizes show it,
    and the names table's equal 3-block split is refused by the head counts on the module's config."""
    from litgpt import GPT, Config

    from lightning_hybrid.tensor_parallel import validate_tensor_parallel_plan
    from lightning_hybrid.tensor_parallel.discover import discover_block_plan

    config = Config(block_size=16, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=8, n_embd=32,
                    bias=False, mlp_class_name="LLaMAMLP", intermediate_size=64, n_query_groups=2)  # fmt: skip
    net = GPT(config)
    with pytest.raises(HybridConfigError, match=r"unequal parts \[32, 8, 8\].*Found so far: .*mlp.fc_1"):
        discover_block_plan(net, "transformer.h.0", torch.zeros(1, 8, dtype=torch.long))
    plan = build_tensor_parallel_plan(net, find_model_structure(net))
    with pytest.raises(HybridConfigError, match=r"attn.qkv' is split as 3 equal fused blocks.*n_head=8, n_query_gr"):
        validate_tensor_parallel_plan(net, plan, 2)
