"""Context parallel (docs/context-parallel.md): each sample's sequence split over the context ranks of a replica,
against one device of the same module, data and seed (fp32, 1e-5 relative: losses, final parameters, first-step
gradients).

Hugging Face Llama and litgpt's GPT built from configs, at cp2, cp4, cp2 x dp2 (ZeRO-2/3) and cp2 x tp2; families
the implementation was not written against (GPT-2's learned positions, Qwen3's q/k norms, BERT's bidirectional
encoder); a causal LM's own loss from ``labels=`` with ignored tokens, whose shift crosses the ranks' boundary and
whose token counts differ between ranks. The multi-process scenarios run in the shared 2- and 4-process launches;
refusals in one process where no process group is needed.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from lightning_hybrid import HybridConfigError, HybridStrategy, ParallelLayout
from lightning_hybrid.context_parallel import plan_context_parallel, shard_batch
from lightning_hybrid.topology import format_rank_table
from tests.conftest import relative_error, share
from tests.harness import build_module, run_reference

STEPS, BATCH, TOL = 3, 4, 1e-5
LITGPT = {"n_layer": 2}


def _scenario(name: str, model: str, strategy: dict[str, Any], dp: int, **extra: Any) -> dict[str, Any]:
    return {"name": f"cp-{name}", "model": model, "model_kwargs": LITGPT if model.startswith("litgpt") else {},
            "dataset": "tokens", "strategy": strategy, "steps": STEPS, "batch_size": BATCH, "data_parallel_size": dp,
            **extra}  # fmt: skip


CP2 = {"context_parallel_size": 2}
MISTRAL = {"head_dim": 8, "intermediate_size": 64, "num_key_value_heads": 2}
CP2_TP2_PP2 = {**CP2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
# name -> (scenario, world)
PARITY: dict[str, tuple[dict[str, Any], int]] = {
    s["name"]: (s, world)
    for world, scenarios in {
        2: [
            _scenario("hf-llama-cp2", "hf-llama", CP2, 1),
            _scenario("litgpt-cp2", "litgpt_llama", CP2, 1),
            _scenario("hf-gpt2-cp2", "hf-gpt2", CP2, 1),  # learned absolute positions
            _scenario("hf-qwen3-cp2", "hf-qwen3", CP2, 1),
            _scenario("hf-bert-cp2", "hf-bert", CP2, 1),  # bidirectional: no causal mask
            # its sliding window (4096 by default) is longer than the sequence: nothing to mask
            {**_scenario("hf-mistral-cp2", "hf-mistral", CP2, 1), "model_kwargs": MISTRAL},
            _scenario("labels-llama-cp2", "cp-labels-llama", CP2, 1),
            # the checkpointed blocks' recompute runs the forward's all-to-alls again, in backward
            _scenario("hf-llama-cp2-recompute-full", "hf-llama", {**CP2, "activation_checkpointing": "full"}, 1),
            _scenario("hf-llama-cp2-recompute-selective", "hf-llama",
                      {**CP2, "activation_checkpointing": "selective"}, 1),
        ],
        4: [
            _scenario("hf-llama-cp2-dp2-zero3", "hf-llama", {**CP2, "zero_stage": 3}, 2),
            _scenario("hf-llama-cp2-tp2", "hf-llama", {**CP2, "tensor_parallel_size": 2}, 1),
            _scenario("litgpt-cp2-dp2-zero2", "litgpt_llama", {**CP2, "zero_stage": 2}, 2),
            # 2 key/value heads over 4 ranks: each query head's copy is exchanged
            _scenario("hf-llama-cp4", "hf-llama", {"context_parallel_size": 4, "zero_stage": 3}, 1),
            _scenario("hf-llama-cp2-pp2", "hf-llama", {**CP2, "pipeline_parallel_size": 2}, 1),
            _scenario("litgpt-cp2-pp2", "litgpt_llama", {**CP2, "pipeline_parallel_size": 2}, 1),
            # the loss's first-step probe runs on the last stage; the earlier stage's ranks get stand-ins for the output
            _scenario("counted-llama-cp2-pp2", "cp-counted-llama", {**CP2, "pipeline_parallel_size": 2}, 1),
        ],
        8: [
            _scenario("hf-llama-cp2-tp2-pp2", "hf-llama", CP2_TP2_PP2, 1),
            # litgpt's Pythia style: its fused qkv splits over tensor-parallel ranks (the Llama style's GQA one not)
            _scenario("litgpt-pythia-cp2-tp2-pp2", "litgpt_pythia", CP2_TP2_PP2, 1),
        ],
    }.items()
    for s in scenarios
}
REFUSED = _scenario("nanogpt-refused", "nanogpt", CP2, 1, expect_error=True)
# attention soft-capping: asked of the attention function at the first forward, refused there on every rank
SOFTCAP = {**_scenario("hf-gemma2-refused", "hf-gemma2", CP2, 1, expect_error=True), "model_kwargs": {"head_dim": 8}}
# a checkpoint saved at step 2 (ZeRO-1 shards over the data dimension, replicas x context ranks), resumed to step 4
RESUMED = {**_scenario("hf-llama-cp2-resume", "hf-llama", {**CP2, "zero_stage": 1}, 1, resume_after=2), "steps": 4}
# a loss of the user's own that context parallel cannot keep exact: refused by the first-step probe on every rank,
# whatever the model's size (no copy of it: verify_tensor_parallel off) and under a pipeline (the last stage probes)
SHIFT_INSIDE = _scenario("shift-inside-refused", "cp-shift-inside-llama", {**CP2, "verify_tensor_parallel": False}, 1,
                         expect_error=True)  # fmt: skip
SHIFT_INSIDE_PP2 = _scenario("shift-inside-pp2-refused", "cp-shift-inside-llama",
                             {**CP2, "pipeline_parallel_size": 2}, 1, expect_error=True)  # fmt: skip
IGNORED = _scenario("ignored-tokens-refused", "cp-ignored-llama", CP2, 1, expect_error=True)
for _world in (2, 4, 8):
    share(_world, [s for s, w in PARITY.values() if w == _world])
share(2, [REFUSED, SOFTCAP, RESUMED, SHIFT_INSIDE, IGNORED])
share(4, [SHIFT_INSIDE_PP2])


@functools.cache
def _reference(model: str, dp: int) -> dict[str, Any]:
    kwargs = LITGPT if model.startswith("litgpt") else MISTRAL if model == "hf-mistral" else {}
    return run_reference(
        {
            "name": "reference",
            "model": model,
            "model_kwargs": kwargs,
            "dataset": "tokens",
            "steps": STEPS,
            "batch_size": BATCH,
            "data_parallel_size": dp,
        }
    )


@pytest.fixture(scope="session")
def groups(shared_groups):
    return shared_groups


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(PARITY))
def test_context_parallel_trains_like_one_device(groups, name: str) -> None:
    scenario, world = PARITY[name]
    result = groups(world).get(name)
    reference = _reference(scenario["model"], scenario["data_parallel_size"])
    assert result["layout"]["context_parallel_size"] == scenario["strategy"]["context_parallel_size"]
    errors = [(abs(a - b) / abs(b), f"loss at step {i}")
              for i, (a, b) in enumerate(zip(result["losses"], reference["losses"], strict=True))]  # fmt: skip
    for kind in ("params", "grads"):
        assert result[kind].keys() == reference[kind].keys(), kind
        errors += [(relative_error(got, reference[kind][n]), f"{kind} {n}") for n, got in result[kind].items()]
    # what the module logged (rank 0's `train_loss`, with or without sync_dist) is the batch's, not its part's
    assert len(result["logged"]) == len(reference["logged"]) > 0
    errors += [(abs(a - b) / abs(b), f"logged train_loss at step {i}")
               for i, (a, b) in enumerate(zip(result["logged"], reference["logged"]))]  # fmt: skip
    err, where = max(errors, key=lambda e: e[0])
    assert err <= TOL, f"{where}: relative error {err:.2e}"
    # replicas split the data, context ranks of a replica read the same samples
    samplers = [record["sampler"] for record in result["per_rank"]]
    replica = scenario["strategy"]["context_parallel_size"] * result["layout"]["tensor_parallel_size"]
    dp = result["layout"]["data_parallel_size"]
    assert all(samplers[r] == samplers[(r // replica) % dp * replica] for r in range(world))
    assert dp == 1 or samplers[0] != samplers[replica]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["cp-labels-llama-cp2", "cp-counted-llama-cp2-pp2"])
def test_the_loss_probe_leaves_nothing_the_step_can_see(groups, name: str) -> None:
    """The first step's probe of the loss runs the user's step three more times (context_parallel/verify.py): the
    counter and the list on ``self`` still count what one device's run counts, on every rank, each micro-batch a
    call of the step as under "ddp" with that accumulation."""
    scenario, world = PARITY[name]
    result = groups(world).get(name)
    microbatches = result["layout"].get("num_microbatches", 1)
    for rank, record in enumerate(result["per_rank"]):
        assert record["step_calls"] == STEPS * microbatches, f"rank {rank}: {record['step_calls']} calls"
        assert record["step_after"] == [i for i in range(STEPS) for _ in range(microbatches)], f"rank {rank}"


@pytest.mark.timeout(1800)
def test_a_checkpoint_saved_under_context_parallel_resumes_exactly(groups) -> None:
    result = groups(2).get(RESUMED["name"])
    reference = run_reference({**RESUMED, "strategy": None})
    assert len(result["losses"]) == len(reference["losses"]) == 4
    for got, want in zip(result["losses"], reference["losses"], strict=True):
        assert abs(got - want) <= TOL * abs(want)
    for name, want in reference["params"].items():
        assert relative_error(result["params"][name], want) <= TOL, name


@pytest.mark.timeout(1800)
def test_a_network_computing_its_own_positions_or_soft_capping_attention_is_refused_on_every_rank(groups) -> None:
    messages = groups(2).expected_errors(REFUSED["name"])
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert messages[0].startswith("HybridConfigError: `context_parallel_size=2`: NanoGPT holds no attention"), messages
    messages = groups(2).expected_errors(SOFTCAP["name"])
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert "Gemma2Attention asks attention for ['softcap']" in messages[0], messages


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("scenario", "world", "found"),
    [
        (SHIFT_INSIDE, 2, "it depends on pairs of positions across the parts' boundary"),
        (SHIFT_INSIDE_PP2, 4, "it depends on pairs of positions across the parts' boundary"),
        # the ignored targets lie in the last rank's part only, after the positions a prefix would probe
        (IGNORED, 2, "it counts different numbers of tokens on the context ranks (the loss leaves out 0, 16 "),
    ],
    ids=lambda v: v["name"] if isinstance(v, dict) else None,
)
def test_a_loss_context_parallel_cannot_keep_exact_is_refused_before_the_first_step(
    groups, scenario: dict, world: int, found: str
) -> None:
    messages = groups(world).expected_errors(scenario["name"])
    assert len(messages) == world and len(set(messages)) == 1, messages
    assert messages[0].startswith("HybridConfigError: `context_parallel_size=2`: the first batch's loss"), messages
    assert found in messages[0] and "`labels=`" in messages[0], messages
    # the probe runs inside the first training step, before its optimizer step: no loss was ever recorded
    assert not list(groups(world).out_dir.glob(f"{scenario['name']}.pt")), messages


# ------------------------------------------------------------------------------------------------ single process
def test_layout_counts_context_ranks() -> None:
    layout = ParallelLayout.resolve(world_size=16, tensor_parallel_size=2, context_parallel_size=2)
    assert (layout.data_parallel_size, layout.data_dimension_size) == (4, 8)
    # tensor fastest, then context, then replicas (Megatron's order): ranks 0-3 are replica 0's tp x cp
    assert [layout.coordinates(r)[1] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.as_dict()["context_parallel_size"] == 2
    table = format_rank_table(layout, [("host", "cpu", 0)] * 16).splitlines()
    assert table[1].split() == ["rank", "pp", "dp", "cp", "tp", "device"]
    assert table[2 + 6].split()[:5] == ["6", "0", "1", "1", "0"]  # rank 6: replica 1, context rank 1, tensor 0
    names = r"tensor_parallel_size x pipeline_parallel_size x context_parallel_size"
    with pytest.raises(HybridConfigError, match=names):
        ParallelLayout.resolve(world_size=6, tensor_parallel_size=2, context_parallel_size=2)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"context_parallel_size": 0}, r"`context_parallel_size` must be a positive integer"),
        ({"context_parallel_size": 2, "verify_pipeline": True}, r"verify_pipeline=True"),
        ({"context_parallel_size": 2, "expert_parallel_size": 2}, r"`expert_parallel_size=2` yet"),
        ({"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}, r"sequence_parallel"),
        ({"context_parallel_size": 2, "pipeline_parallel_size": 2, "verify_tensor_parallel": True},
         r"verify_tensor_parallel=True`: its unsplit copy"),
        ({"context_parallel_size": 2, "verify_tensor_parallel": True}, r"verify_tensor_parallel=True`: its unsplit"),
        ({"context_parallel_size": 2, "layout": "auto"}, r"context_parallel_size=2"),
    ],
)
def test_what_context_parallel_does_not_compose_with_is_refused_at_construction(arguments, match) -> None:
    with pytest.raises(HybridConfigError, match=match):
        HybridStrategy(**arguments)


@pytest.mark.parametrize(
    ("model", "kwargs", "match"),
    [
        ("nanogpt", {}, r"NanoGPT holds no attention that context parallel can split"),
        ("torch-encoder", {}, r"holds no attention that context parallel can split"),
        ("hf-bloom", {}, r"BloomForCausalLM.forward takes no `position_ids`"),
    ],
)
def test_models_context_parallel_cannot_split_are_refused(model: str, kwargs: dict, match: str) -> None:
    with pytest.raises(HybridConfigError, match=match):
        plan_context_parallel(build_module(model, **kwargs), cp=2, tp=1)


def test_a_checks_run_of_the_step_leaves_nothing_on_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    """What the probe's runs of the user's step leave (lightning_hybrid/unseen_run.py) is put back: attributes set or
    rebound, the items of lists, dicts and sets, buffers changed in place or rebound, torchmetrics states; prints
    and warnings are not shown. The network's subtree is skipped (the probe replaces it)."""
    import warnings

    import torchmetrics
    from torch import nn

    from lightning_hybrid.unseen_run import unseen_run

    class Stepping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)
            self.total = torchmetrics.SumMetric()
            self.register_buffer("seen_steps", torch.zeros(()))
            self.calls, self.outputs, self.by_name, self.names = 0, [1], {"a": 1}, {"a"}

    m = Stepping()
    m.total.update(torch.tensor(2.0))
    before = m.net.weight.clone()
    with unseen_run(m, m.net):
        m.calls += 1
        m.outputs.append(2)
        m.by_name["b"] = 2
        m.names.add("b")
        m.extra = True
        m.seen_steps += 1
        m.total.update(torch.tensor(5.0))
        print("from the probe")
        warnings.warn("from the probe", stacklevel=1)
    assert (m.calls, m.outputs, m.by_name, m.names, hasattr(m, "extra")) == (0, [1], {"a": 1}, {"a"}, False)
    assert float(m.seen_steps) == 0.0 and float(m.total.compute()) == 2.0
    assert torch.equal(m.net.weight, before)
    assert "from the probe" not in capsys.readouterr().out
    with pytest.warns(UserWarning, match="after the probe"):  # the real step's warnings are shown again
        warnings.warn("after the probe", stacklevel=1)


def test_litgpt_soft_capped_attention_is_refused_naming_it() -> None:
    # litgpt soft-caps without torch's SDPA, the call context parallel's exchange is put around
    module = build_module("litgpt_llama", **LITGPT)
    module.model.config.attention_logit_softcapping = 50.0
    with pytest.raises(HybridConfigError, match=re.escape("attention_logit_softcapping=50.0")):
        plan_context_parallel(module, cp=2, tp=1)


def test_heads_must_divide_over_tensor_and_context_ranks() -> None:
    module = build_module("hf-llama")  # 4 heads
    assert plan_context_parallel(module, cp=2, tp=2).huggingface == [module.model]
    with pytest.raises(HybridConfigError, match=re.escape("`context_parallel_size=4` x `tensor_parallel_size=2`")):
        plan_context_parallel(module, cp=4, tp=2)
    assert plan_context_parallel(build_module("litgpt_llama", **LITGPT), cp=4, tp=1).litgpt


def test_each_context_rank_keeps_its_contiguous_part_of_the_sequence() -> None:
    x, y, n = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 100, torch.tensor([1, 2])
    parts = [shard_batch((x, {"y": y, "n": n}), rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), x)
    assert torch.equal(parts[1][1]["y"], y[:, 2:4]) and parts[1][1]["y"].is_contiguous()
    assert parts[3][1]["n"] is n  # one value per sample: kept whole
    with pytest.raises(HybridConfigError, match=r"sequence lengths are \[6\]"):
        shard_batch(torch.zeros(2, 6), 0, 4)
    with pytest.raises(HybridConfigError, match=r"sequence lengths are \[7, 8\]"):
        shard_batch((torch.zeros(2, 8), torch.zeros(2, 7)), 0, 2)


def test_the_planner_counts_context_ranks() -> None:
    from lightning_hybrid.planning import plan

    sizes = {"params": 6.7e9, "layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq": 8192, "micro_batch": 1,
             "precision": "bf16", "recompute": "none", "nodes": 1, "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "zero_stage": 1, "attention": "flash"}  # fmt: skip
    one, two = (plan(**sizes, context_parallel_size=cp).layouts[0] for cp in (1, 2))
    assert two.candidate.sizes() == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 4,
        "zero_stage": 1,
        "expert_parallel_size": 1,
        "context_parallel_size": 2,
    }
    # each rank holds half of each sample's tokens, and per block attention's output once more (exchanged back to the
    # rank's tokens beside SDPA's saved copy: 4096 tokens x hidden, bf16); ZeRO shards over replicas x context ranks
    exchanged_output = sizes["layers"] * (sizes["seq"] // 2) * sizes["hidden"] * 2
    assert two.ledger.activations == pytest.approx(one.ledger.activations / 2 + exchanged_output)
    assert one.ledger.optimizer == two.ledger.optimizer
    assert one.tokens == 2 * two.tokens  # 8 replicas' samples against 4
    refused = plan(**{**sizes, "heads": 2}, context_parallel_size=4).layouts[0]
    assert not refused.feasible and "context parallel (1 x 4) does not divide heads=2" in refused.reason


def test_the_users_model_config_is_left_as_it_was() -> None:
    """transformers reads each attention module's ``config._attn_implementation`` at every call: context parallel
    gives the modules a copy naming its attention, and the config the user made (and a checkpoint saves) keeps its
    own value."""
    from lightning_hybrid.context_parallel import ContextShard, apply_context_parallel
    from lightning_hybrid.context_parallel.attention import ATTENTION_NAME

    module = build_module("hf-llama")
    config = module.model.config
    before = config._attn_implementation
    apply_context_parallel(plan_context_parallel(module, cp=2, tp=1), ContextShard(group=None, rank=0, size=2))
    assert config._attn_implementation == before != ATTENTION_NAME
    holders = [m for m in module.model.modules() if "config" in m.__dict__]
    assert holders and all(m.config._attn_implementation == ATTENTION_NAME for m in holders)
    assert all(m.config is not config for m in holders)
