"""Tensor-parallel plans for models written by others: every style name transformers 5 declares is translated into
torch's styles or refused with the style named; a model whose layer names tell nothing gets its plan from the data flow
of one forward. That the models using these plans train at tp=2 like one device is the model zoo's (test_zoo.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.pipeline.verify import TOLERANCES, PipelineVerifier
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
            translated = style_from_name(style, "layer", target, rope_dim=2 if style == "mla_kv_a_proj" else None)
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


def test_multi_head_latent_attention_needs_its_rotary_width() -> None:
    """transformers' 'mla_kv_a_proj' sums the rotary keys' gradient: without their width (the attention's
    `qk_rope_head_dim`) it is refused, naming the style."""
    with pytest.raises(HybridConfigError, match=r"style 'mla_kv_a_proj', but its attention module has no"):
        style_from_name("mla_kv_a_proj", "layers.0.self_attn.kv_a_proj_with_mqa", nn.Linear(8, 6))


def test_expert_weights_without_a_local_module_style_are_refused() -> None:
    module = _hf("mixtral")
    structure = find_model_structure(module)
    # the expert weights split, the experts module given no style (written out: transformers 5.25's Mixtral plan no
    # longer splits experts at all, its earlier releases did with 'moe_tp_experts')
    plan = {f"model.{k}": v for k, v in module.model._tp_plan.items() if ".experts" not in k}
    plan |= {"model.model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
             "model.model.layers.*.mlp.experts.down_proj": "rowwise"}  # fmt: skip
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


def test_gpt2_conv1d_layers_get_the_transposed_styles_and_the_fused_c_attn_its_parts() -> None:
    """Before: the names table read nn.Linear only and the data-flow plan refused ``Conv1D`` ('splits nn.Linear and
    nn.Embedding layers only'). HF GPT-2 trains at tp=2 and in 3D like one device in the zoo."""
    from lightning_hybrid.tensor_parallel.styles import Conv1DColwiseParallel, Conv1DRowwiseParallel
    from lightning_hybrid.tensor_parallel.styles import FusedColwiseParallel as Fused

    module = _hf("gpt2")
    plan = build_tensor_parallel_plan(module, find_model_structure(module))
    block = "model.transformer.h.0"
    assert {k[len(block) + 1 :]: type(v) for k, v in plan.styles.items() if k.startswith(block + ".")} == {
        "attn.c_attn": Fused, "attn.c_proj": Conv1DRowwiseParallel, "mlp.c_fc": Conv1DColwiseParallel,
        "mlp.c_proj": Conv1DRowwiseParallel,
    }  # fmt: skip
    assert plan.styles[f"{block}.attn.c_attn"].num_blocks == 3
    # GPT-2's forward splits c_attn's output by `split_size` and reshapes by head_dim: both follow the local heads
    assert f"{block}.attn" in plan.attention_modules


class _Qkv(nn.Module):
    """A GPT-2 look-alike attention: a Conv1D ``c_attn`` whose q|k|v parts are unequal (multi-query, as GPTBigCode)."""

    def __init__(self, width: int = 16, kv: int = 4) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.num_heads, self.kv = 4, kv
        self.c_attn, self.c_proj = Conv1D(width + 2 * kv, width), Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split([x.shape[-1], self.kv, self.kv], dim=-1)
        return x + self.c_proj(q * k.mean(-1, keepdim=True) + v.mean(-1, keepdim=True))


class _TinyLM(nn.Module):
    def __init__(self, block: type, n: int = 2) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(32, 16), nn.ModuleList(block() for _ in range(n)), None
        self.head = nn.Linear(16, 32)
        self.example_input_array = torch.zeros(2, 4, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_fused_projection_named_like_gpt2s_but_split_unequally_is_refused() -> None:
    net = _TinyLM(_Qkv)
    with pytest.raises(HybridConfigError, match=r"'blocks.0.c_attn' is split into the parts \[16, 4, 4\] by the for"):
        build_tensor_parallel_plan(net, find_model_structure(net))


def test_bert_splits_close_in_the_sibling_output_modules() -> None:
    """Before: 'splits layers of ...attention.self but has no row-wise (output) projection there'. HF BERT trains at
    tp=2 and in 3D like one device in the zoo."""
    from tests.zoo_models import HFMaskedLM

    module = HFMaskedLM("bert")
    plan = build_tensor_parallel_plan(module, find_model_structure(module))
    layer = "model.bert.encoder.layer.0"
    assert {k[len(layer) + 1 :]: type(v).__name__ for k, v in plan.styles.items() if k.startswith(layer + ".")} == {
        "attention.self.query": "ColwiseParallel", "attention.self.key": "ColwiseParallel",
        "attention.self.value": "ColwiseParallel", "attention.output.dense": "RowwiseParallel",
        "intermediate.dense": "ColwiseParallel", "output.dense": "RowwiseParallel",
    }  # fmt: skip
    assert plan.closed_by[f"{layer}.attention.self.query"] == f"{layer}.attention.output.dense"
    assert f"{layer}.attention.self" in plan.attention_modules
    # the sibling's norm runs after the row-wise split, on whole tensors: its gradients are averaged, not summed
    assert not {f"{layer}.attention.output", f"{layer}.output"} & (plan.inside_split | plan.sharded_region_modules)


class _SelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, 4)
        q, k, v = (m(x).view(shape).transpose(1, 2) for m in (self.query, self.key, self.value))
        return (q @ k.transpose(-1, -2)).softmax(-1).matmul(v).transpose(1, 2).reshape(*x.shape[:-1], -1)


class _SelfOutput(nn.Module):
    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        self.dense, self.norm, self.norm_first = nn.Linear(16, 16), nn.LayerNorm(16), norm_first

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.norm_first:  # reads the sharded activation before the row-wise projection
            h = self.norm(h)
        return self.norm(self.dense(h) + x)


class _BertLikeLayer(nn.Module):
    """BERT's layout: attention.self (q, k, v) -> attention.output (dense) in sibling modules; ``between`` puts
    something that reads the sharded activation between them."""

    between = ""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _SelfAttn()
        self.output = _SelfOutput(norm_first=self.between == "norm in the sibling")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(x)
        if self.between == "residual":
            h = h + x
        elif self.between == "scale":
            h = h * x.mean()
        return self.output(h, x)


@pytest.mark.parametrize("between", ["residual", "scale", "norm in the sibling"])
def test_a_sibling_split_that_something_else_reads_on_the_way_is_refused(between: str) -> None:
    exact = _TinyLM(_BertLikeLayer)
    plan = build_tensor_parallel_plan(exact, find_model_structure(exact))
    assert plan.closed_by["blocks.0.self_attn.query"] == "blocks.0.output.dense"
    layer = type("Layer", (_BertLikeLayer,), {"between": between})
    net = _TinyLM(layer)
    # a full-width norm ends what the data flow follows (it is the residual stream's): no split is found there at all
    refusal = "found no pair of projections" if between.startswith("norm") else "before 'output.dense'"
    with pytest.raises(HybridConfigError, match=rf"`tensor_parallel_plan='auto'` .*{refusal}"):
        build_tensor_parallel_plan(net, find_model_structure(net))


class _NormInside(nn.Module):
    """An MLP with a norm over its hidden features between its two layers (NormFormer): each rank would normalize
    its shard of the features alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.proj = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(self.fc(x)))


def test_a_norm_over_the_sharded_features_is_refused() -> None:
    """Before: split silently (the norm's statistics over one rank's half of the features)."""
    net = _TinyLM(_NormInside)
    with pytest.raises(HybridConfigError, match=r"'norm' \(LayerNorm\) computes over all the features of \['fc'\]"):
        build_tensor_parallel_plan(net, find_model_structure(net))


def test_a_dict_plan_may_close_a_split_in_a_sibling_module_the_data_flow_checks() -> None:
    """Before: 'splits layers of ...self_attn but has no row-wise (output) projection there' for any dict plan."""
    plan = {"blocks.*.self_attn.query": "colwise", "blocks.*.self_attn.key": "colwise",
            "blocks.*.self_attn.value": "colwise", "blocks.*.output.dense": "rowwise"}  # fmt: skip
    exact = _TinyLM(_BertLikeLayer)
    found = build_tensor_parallel_plan(exact, find_model_structure(exact), plan)
    assert found.closed_by["blocks.1.self_attn.value"] == "blocks.1.output.dense"
    assert found.sharded_region_modules == {"blocks.0.self_attn", "blocks.1.self_attn"}
    net = _TinyLM(type("Layer", (_BertLikeLayer,), {"between": "residual"}))
    with pytest.raises(HybridConfigError, match=r"applies 'add' to the sharded output of \['self_attn.query'"):
        build_tensor_parallel_plan(net, find_model_structure(net), plan)


# ------------------------------------------------------------------------------------------------ the first-step check
def _verifier(measured: tuple[float, float]) -> PipelineVerifier:
    return PipelineVerifier(None, None, None, TOLERANCES["32-true"], measured=measured, option="verify_tensor_parallel")


def test_a_loss_near_zero_is_compared_at_the_scale_of_its_terms() -> None:
    """EXAONE-MoE at tp2 was refused: its check value -0.00806 differed by 1.4e-6 (1.8e-4 relative) while the
    gradient norms agreed to 2e-9. Below 1 the loss's error is absolute; the gradient norm and larger losses stay
    relative, so a wrong value is still refused."""
    _verifier((-0.0080614, 0.25)).compare((-0.0080600, 0.25 * (1 + 2e-9)))  # rounding of cancelling terms: accepted
    with pytest.raises(HybridConfigError, match=r"value -0.00806 vs -0.00906 \(error 1.0e-03\)"):
        _verifier((-0.00806, 0.25)).compare((-0.00906, 0.25))
    with pytest.raises(HybridConfigError, match=r"value 5.001 vs 5 \(error 2.0e-04\)"):
        _verifier((5.001, 0.25)).compare((5.0, 0.25))
    with pytest.raises(HybridConfigError, match=r"gradient norm 0.25 vs 0.2501"):
        _verifier((-0.0080614, 0.25)).compare((-0.0080614, 0.2501))


def test_the_check_projection_is_scaled_by_its_terms_magnitude() -> None:
    """The random projection of the network's output is divided by the sum of its terms' magnitudes: a value in
    [-1, 1] whose rounding is absolute, whatever the output's size; its gradient points the same way."""
    from lightning_hybrid.pipeline.verify import projection

    logits = torch.randn(2, 8, 50, requires_grad=True)
    value = projection((logits, torch.ones(3, dtype=torch.long)))
    weights = torch.randn((2, 8, 50), generator=torch.Generator().manual_seed(0))
    terms = logits.detach() * weights
    assert -1 <= float(value) <= 1
    assert float(value) == pytest.approx(float(terms.sum() / terms.abs().sum()), rel=1e-6)
    value.backward()
    assert torch.allclose(logits.grad, weights / terms.abs().sum(), rtol=1e-6)
    assert projection(torch.ones(3, dtype=torch.long)) is None
