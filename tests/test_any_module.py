"""Plain data parallel and ZeRO train any module: a CNN and an MLP with no repeated block list
(tests/any_module_models.py), against one device of the same module, data and seed.

BatchNorm: under data parallel each replica normalizes with the statistics of its own local batch, as Lightning's
DDP does without SyncBatchNorm, so a one-device run on the global batch is not the reference. The CNN's reference
(``bn_replicas=2``) feeds each replica's slice of the global batch through the network separately: the same
computation, compared exactly (1e-5). Its BatchNorm is in training mode throughout. ``Trainer(sync_batchnorm=True)``
needs torch's SyncBatchNorm, which runs on GPUs only: on CPU it is refused with a clear error.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hybrid import HybridConfigError
from lightning_hybrid.structure import block_list_needed_by, find_model_structure
from tests.conftest import relative_error, share
from tests.harness import run_reference
from tests.test_foundation import STEPS

BATCH = 4
TOL = 1e-5
MODEL_KWARGS = {"cnn": {"bn_replicas": 2}, "mlp": {}}
MLP_PLAN = {"body.0": "colwise", "body.2": "rowwise"}


def scenario(name: str, model: str, strategy: Any, dp: int = 2, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "model_kwargs": MODEL_KWARGS[model], "strategy": strategy, "steps": STEPS,
            "batch_size": BATCH, "data_parallel_size": dp, "dataset": "images", **extra}  # fmt: skip


# a logger: the strategy adds its HybridMonitor, which measures the MLP's training FLOPs (not a transformer)
MONITORED = {"logger": "csv", "trainer": {"log_every_n_steps": 2},
             "after_fit": "tests.any_module_models:monitor_record"}  # fmt: skip
PARITY = [
    # the registered name with its defaults, as a user writes it: `Trainer(strategy="hybrid", devices=2)` (ZeRO-1)
    scenario("cnn-dp2-by-name", "cnn", "hybrid"),
    *[scenario(f"cnn-dp2-zero{z}", "cnn", {"zero_stage": z}) for z in (0, 2, 3)],
    *[scenario(f"mlp-dp2-zero{z}", "mlp", {"zero_stage": z}) for z in (0, 1, 2)],
    scenario("mlp-dp2-zero3", "mlp", {"zero_stage": 3}, **MONITORED),
    # tensor parallel with a dict plan needs no block list either
    scenario(
        "mlp-tp2-dictplan", "mlp", {"tensor_parallel_size": 2, "tensor_parallel_plan": MLP_PLAN}, dp=1, **MONITORED
    ),
]
# BatchNorm's running statistics differ between the replicas: the checkpoint takes the first replica's (as DDP saves
# rank 0's), and the resumed run continues the one-device reference exactly (training mode uses batch statistics)
RESUMED = [scenario("cnn-dp2-zero1-resumed", "cnn", {"zero_stage": 1}, resume_after=4)]
ERRORS = [
    scenario("error-cnn-pp2", "cnn", {"pipeline_parallel_size": 2}, expect_error=True),
    scenario("error-cnn-ac", "cnn", {"activation_checkpointing": True}, expect_error=True),
    scenario("error-cnn-tp2-auto", "cnn", {"tensor_parallel_size": 2}, expect_error=True),
    scenario("error-cnn-sync-bn-cpu", "cnn", {"zero_stage": 1}, trainer={"sync_batchnorm": True}, expect_error=True),
]
share(2, PARITY + RESUMED + ERRORS)


def mp_scenario(name: str, strategy: dict[str, Any], dp: int, **extra: Any) -> dict[str, Any]:
    """The module written for Lightning's ModelParallelStrategy (tests/foreign_models.py), on token windows."""
    return {"name": name, "model": "lightning_mp", "model_kwargs": {}, "strategy": strategy, "steps": STEPS,
            "batch_size": BATCH, "data_parallel_size": dp, **extra}  # fmt: skip


# its configure_model slices self.device_mesh["tensor_parallel"] / ["data_parallel"] and applies the plan and
# fully_shard itself: HybridStrategy applies neither again
MODEL_PARALLEL = [
    mp_scenario("lightning-mp-tp2", {"tensor_parallel_size": 2}, dp=1),
    mp_scenario("lightning-mp-dp2-zero3", {"zero_stage": 3}, dp=2),
]
MODEL_PARALLEL_4 = [mp_scenario("lightning-mp-tp2-dp2-zero3", {"tensor_parallel_size": 2, "zero_stage": 3}, dp=2)]
MP_ERRORS = [mp_scenario("error-lightning-mp-dp2-zero1", {"zero_stage": 1}, dp=2, expect_error=True)]
share(2, MODEL_PARALLEL + MP_ERRORS)
share(4, MODEL_PARALLEL_4)


@pytest.fixture(scope="session")
def group2(shared_groups):
    return shared_groups(2)


@functools.cache
def _reference(model: str, dp: int) -> dict[str, Any]:
    # every ZeRO stage of a model trains like the same one-device run
    return run_reference(scenario("reference", model, {}, dp=dp))


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", PARITY + RESUMED, ids=[s["name"] for s in PARITY + RESUMED])
def test_data_parallel_of_a_module_without_blocks_matches_one_device(group2, case: dict[str, Any]) -> None:
    from lightning_hybrid.sharding import expected_model_state_bytes

    result, reference = group2.get(case["name"]), _reference(case["model"], case["data_parallel_size"])
    layout = result["layout"]
    assert layout["data_parallel_size"] == case["data_parallel_size"]
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} vs one device {want}"
    for kind in ("params", "grads"):  # final parameters; first-step gradients gathered over the ZeRO shards
        assert result[kind].keys() == reference[kind].keys()
        for name, want in reference[kind].items():
            err = relative_error(result[kind][name], want)
            assert err <= TOL, f"{kind} {name}: relative error {err:.2e}"
    if layout["tensor_parallel_size"] > 1:  # the plan really split the body
        total = sum(p.numel() for p in reference["params"].values())
        assert all(record["local_numel"] < total for record in result["per_rank"])
    # ZeRO really shards (ZeRO-3: the whole module, though it has no block list), to the formula within 5%
    for rank, record in enumerate(result["per_rank"]):
        expected = expected_model_state_bytes(
            record["local_numel"], zero_stage=layout["zero_stage"], data_parallel_size=layout["data_parallel_size"]
        )
        for key, want in expected.items():
            got = record["model_state"][key]
            assert abs(got - want) <= 0.05 * want, f"rank {rank} {key}: measured {got}, formula {want}"


@pytest.mark.parametrize("case", [c for c in PARITY if "after_fit" in c], ids=lambda c: c["name"])
def test_flops_of_a_module_that_is_not_a_transformer_are_lightnings_measure_flops_on_one_device(group2, case) -> None:
    """The monitor counts a step's FLOPs as Lightning's ``measure_flops`` does on one device (forward and backward
    of the training step, torch's FLOP counter), exactly, on every rank though ZeRO-3 shards the MLP and tensor
    parallel splits it (measured on the unsplit module's meta copy); the achieved FLOP/s it logs on CPU is that count
    per sample times the samples per second."""
    from lightning.fabric.utilities.throughput import measure_flops

    from tests.any_module_models import IMAGE_SHAPE, SmallMLP

    one_device = SmallMLP()
    one_device.log = lambda *args, **kwargs: None  # no trainer to log to
    batch = (torch.zeros(BATCH, *IMAGE_SHAPE), torch.zeros(BATCH, dtype=torch.long))
    step_flops = measure_flops(one_device, lambda: one_device.training_step(batch, 0), loss_fn=lambda loss: loss)
    parameters = sum(p.numel() for p in one_device.parameters())
    assert step_flops > 0 and step_flops != 6 * parameters * BATCH  # not the transformer formula
    record = group2.get(case["name"])["after_fit"]
    assert [per_sample * BATCH for per_sample in record["flops_per_sample"]] == [step_flops] * 2, record
    metrics = record["metrics"]
    achieved = metrics["throughput/flops_per_s"] / metrics["throughput/samples_per_s"]
    assert achieved == pytest.approx(step_flops / BATCH, rel=1e-9)
    assert metrics["throughput/flops_per_s_per_device"] == pytest.approx(metrics["throughput/flops_per_s"] / 2)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("error-cnn-pp2", r"`pipeline_parallel_size=2` \(the pipeline stages are cut between blocks\) needs them"),
        ("error-cnn-ac", r"`activation_checkpointing=True` .* needs them"),
        ("error-cnn-tp2-auto", r"`tensor_parallel_plan='auto'` .* needs them"),
        ("error-cnn-sync-bn-cpu", r"`Trainer\(sync_batchnorm=True\)` on 'cpu': torch's SyncBatchNorm runs on"),
    ],
)
def test_settings_that_need_what_the_module_lacks_are_refused_on_every_rank(group2, name: str, match: str) -> None:
    messages = group2.expected_errors(name)
    assert len(messages) == 2, f"expected the error on both ranks, got {messages}\n{group2.log[-3000:]}"
    for message in messages:
        assert message.startswith("HybridConfigError") and re.search(match, message), message
        if "sync-bn" not in name:
            assert "transformer_blocks=" in message and "SmallCNN" in message, message


# ------------------------------------------------------------------------------------------------ single process
def test_a_module_without_blocks_has_a_structure_without_blocks() -> None:
    from tests.any_module_models import SmallCNN

    s = find_model_structure(SmallCNN())
    assert (s.blocks_name, s.num_blocks, s.block_names(), s.network_name) == (None, 0, [], "")
    with pytest.raises(HybridConfigError, match=r"in SmallCNN .*`pipeline_parallel_size=4`.*transformer_blocks="):
        find_model_structure(SmallCNN(), needed_by=block_list_needed_by(pipeline_parallel_size=4))
    assert block_list_needed_by(tensor_parallel_auto_plan=False) == []


def test_zero3_units_come_before_the_modules_around_them() -> None:
    """FSDP2 takes the parameters no wrapped submodule holds: an outer module wrapped first would take its children's
    parameters, and wrapping a child again then fails. The LightningModule itself is never a unit."""
    from tests.any_module_models import SmallMLP

    assert find_model_structure(SmallMLP()).fully_shard_roots(SmallMLP()) == ["body", "norm", "head"]

    class BlocksOnTheRoot(nn.Module):  # the block list is a child of the root, beside the embedding and head
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.extra = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.ReLU()})  # no forward: its children instead
            self.head = nn.Linear(8, 16)
            self.scale = nn.Parameter(torch.ones(8))  # held by the root: stays replicated

    net = BlocksOnTheRoot()
    s = find_model_structure(net)
    assert (s.network_name, s.blocks_name) == ("", "blocks")
    assert s.fully_shard_roots(net) == ["emb", "extra.a", "head"]


def test_a_dict_plan_needs_no_block_list() -> None:
    from lightning_hybrid.tensor_parallel import build_tensor_parallel_plan

    net = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), nn.LayerNorm(8))
    structure = find_model_structure(net)
    assert structure.blocks_name is None
    plan = build_tensor_parallel_plan(net, structure, {"1.0": "colwise", "1.2": "rowwise"})
    assert plan.sharded_region_modules == {"1"}


def test_sync_batchnorm_converts_over_the_data_parallel_group_only() -> None:
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    from lightning_hybrid.batch_norm import sync_batch_norm
    from tests.any_module_models import SmallCNN

    module, group = SmallCNN(), object()  # the group is only stored at conversion
    weight = module.net[3].weight
    sync_batch_norm(module, TorchSyncBatchNorm(), group, "cuda")
    assert isinstance(module.net[3], nn.SyncBatchNorm) and module.net[3].process_group is group
    assert module.net[3].weight is weight  # the same parameter: the optimizer built later steps it
    with pytest.raises(HybridConfigError, match=r"sync_batchnorm=True\)` on 'cpu'"):
        sync_batch_norm(SmallCNN(), TorchSyncBatchNorm(), group, "cpu")
    sync_batch_norm(nn.Linear(2, 2), TorchSyncBatchNorm(), group, "cpu")  # no BatchNorm: nothing to refuse


# ------------------------------------------------------------------------------------------------ ModelParallelStrategy
@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    "case", MODEL_PARALLEL + MODEL_PARALLEL_4, ids=[s["name"] for s in MODEL_PARALLEL + MODEL_PARALLEL_4]
)
def test_a_module_written_for_lightnings_model_parallel_strategy_trains_unchanged(shared_groups, case) -> None:
    """Lightning's guide: ``configure_model`` calls ``parallelize_module(..., self.device_mesh["tensor_parallel"],
    plan)`` and ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``. It used to fail at once with
    ``KeyError: Invalid mesh_dim_names ('tensor_parallel',)``; now it matches one device, with the user's plan and
    sharding applied once."""
    from tests.test_foundation import assert_parity

    world = 4 if case in MODEL_PARALLEL_4 else 2
    result = shared_groups(world).get(case["name"])
    assert_parity(result, run_reference(case))
    layout = result["layout"]
    total = sum(p.numel() for p in result["params"].values())
    # the user's split really happened: tensor parallel leaves each rank part of the elements, fully_shard part of
    # the parameter bytes (fp32)
    if layout["tensor_parallel_size"] > 1:
        assert all(record["local_numel"] < total for record in result["per_rank"])
    if layout["zero_stage"] == 3:
        assert all(record["model_state"]["parameters"] < 4 * total for record in result["per_rank"])


def test_a_module_sharded_by_its_own_configure_model_needs_zero_stage_3(shared_groups) -> None:
    messages = shared_groups(2).expected_errors("error-lightning-mp-dp2-zero1")
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert re.search(
        r"`zero_stage=1`, but the LightningModule's `configure_model` already applied FSDP2's", messages[0]
    )


def test_the_mesh_answers_to_lightnings_dimension_names(tmp_path) -> None:
    """One process: the names of Lightning's ModelParallelStrategy slice the same dimensions as ours."""
    import torch.distributed as dist

    from lightning_hybrid.layout import ParallelLayout
    from lightning_hybrid.topology import build_device_mesh, with_lightning_names

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = with_lightning_names(build_device_mesh(ParallelLayout.resolve(world_size=1), "cpu"))
        assert mesh == build_device_mesh(ParallelLayout.resolve(world_size=1), "cpu")
        for lightning_name, ours in (("data_parallel", "data"), ("tensor_parallel", "tensor"),
                                     ("pipeline_parallel", "pipeline")):  # fmt: skip
            assert mesh[lightning_name] == mesh[ours] and mesh[lightning_name].mesh_dim_names == (ours,)
            assert mesh.get_local_rank(lightning_name) == 0 and mesh.get_group(lightning_name) is not None
        assert mesh[("data_parallel", "tensor_parallel")].mesh_dim_names == ("data", "tensor")
    finally:
        dist.destroy_process_group()
