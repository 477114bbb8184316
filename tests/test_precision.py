"""Issue: precision. fp16 loss scaling agreed by every rank, fp32 master weights under '-true' precisions, mixed
precision close to fp32, clipping, and the model-state report per precision.

Every multi-process scenario runs in one launched group of 8 CPU processes (2x2x2 and other 8-rank layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_hybrid import HybridPrecision
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.precision import DynamicLossScaler, LossScaleError, LossScalerOptions
from lightning_hybrid.sharding import expected_model_state_bytes
from tests.conftest import relative_error, share
from tests.harness import run_reference
from tests.test_foundation import STEPS, assert_parity

BATCH = 4
NANOGPT = {"bias": False}
LAYOUT_3D = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
INJECT_STEP, INJECT_RANK = 2, 5
MIXED_STEPS = 25


def _scenario(name: str, strategy: dict[str, Any], dp: int, steps: int, **extra: Any) -> dict[str, Any]:
    model_kwargs = {**NANOGPT, **extra.pop("model_kwargs", {})}
    return {"name": name, "model": extra.pop("model", "nanogpt"), "model_kwargs": model_kwargs, "strategy": strategy,
            "steps": steps, "batch_size": BATCH, "data_parallel_size": dp, **extra}  # fmt: skip


OVERFLOW = [
    _scenario(
        f"overflow-{name}",
        strategy,
        dp,
        5,
        model="nanogpt_scheduled",
        precision_plugin={"precision": precision, "hysteresis": 1, "initial_scale": 2.0**10},
        inject_inf={"step": INJECT_STEP, "rank": INJECT_RANK},
        probe=True,
    )
    for name, strategy, dp, precision in [
        ("2x2x2-zero1-16mixed", {**LAYOUT_3D, "zero_stage": 1, "track_gradient_norm": True}, 2, "16-mixed"),
        ("2x2x2-zero3-16mixed", {**LAYOUT_3D, "zero_stage": 3, "track_gradient_norm": True}, 2, "16-mixed"),
        (
            "tp2-dp4-zero2-16true",
            {"tensor_parallel_size": 2, "zero_stage": 2, "track_gradient_norm": True},
            4,
            "16-true",
        ),
    ]
]
GROWTH = _scenario(
    "growth-2x2x2-zero2",
    {**LAYOUT_3D, "zero_stage": 2},
    2,
    6,
    precision_plugin={"precision": "16-mixed", "initial_scale": 256.0, "growth_interval": 2},
    probe=True,
)
# the same run stopped after step 3 (mid-epoch) by a ModelCheckpoint and resumed with a fresh plugin
RESUME = {**GROWTH, "name": "resume-growth-2x2x2-zero2", "resume_after": 3}
TINY_LR = 1e-3  # below half of bf16's spacing at 1.0 (2**-9 ~ 1.95e-3): a bf16 parameter alone would never move
TINY_STEPS = 10
TINY = [
    _scenario(
        f"tiny-updates-{name}",
        strategy,
        dp,
        TINY_STEPS,
        model="nanogpt_tiny_updates",
        model_kwargs={"learning_rate": TINY_LR},
        trainer={"precision": "bf16-true"},
        probe=True,
    )
    for name, strategy, dp in [
        ("pp2-dp4-zero0", {"pipeline_parallel_size": 2, "zero_stage": 0}, 4),
        ("dp8-zero2", {"zero_stage": 2}, 8),
    ]
]
MIXED = [
    _scenario(
        f"mixed-{precision}-2x2x2",
        {**LAYOUT_3D, "zero_stage": 1},
        2,
        MIXED_STEPS,
        model_kwargs={"learning_rate": 1e-3},
        # on CPU, Lightning turns Trainer(precision="16-mixed") into bf16-mixed: the plugin asks for fp16 explicitly
        precision_plugin={"precision": precision},
    )
    for precision in ("16-mixed", "bf16-mixed")
]
STATE = [
    _scenario(f"state-bf16-true-{name}", strategy, dp, 2, trainer={"precision": "bf16-true"})
    for name, strategy, dp in [
        ("2x2x2-zero1", {**LAYOUT_3D, "zero_stage": 1}, 2),
        ("tp2-dp4-zero2", {"tensor_parallel_size": 2, "zero_stage": 2}, 4),
        ("tp2-dp4-zero3", {"tensor_parallel_size": 2, "zero_stage": 3}, 4),
    ]
]
CLIP_VALUE = _scenario(
    "clip-value-2x2x2-zero1",
    {**LAYOUT_3D, "zero_stage": 1},
    2,
    STEPS,
    trainer={"gradient_clip_val": 2e-3, "gradient_clip_algorithm": "value"},
)

# An fp16 overflow storm at 2x2x2 ZeRO-1: 40 steps in a row whose fp16 logits overflow on data replica 1
# (tests/precision_probe.py, Storm), after 3 clean steps and followed by 4. The scaler has Megatron/DeepSpeed's
# hysteresis 2 and min_scale 1: the scale backs off from 2**9 to the floor in 10 overflows and stays there for 30.
STORM_START, STORM_STEPS, STORM_AFTER, STORM_STOP_AFTER = 3, 40, 4, 3
STORM_SCALER = {"initial_scale": 2.0**8, "growth_interval": 3}


def _storm_scales(overflows: list[bool]) -> tuple[list[float], list[float]]:
    """The loss scale each step uses, and the one after it, by the scaler's own rules (computed here, in one process:
    the test checks that all 8 ranks follow them)."""
    scaler = DynamicLossScaler(**STORM_SCALER)
    used, after = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for found_inf in overflows:
            used.append(scaler.scale)
            scaler.update(found_inf)
            after.append(scaler.scale)
    return used, after


STORM_OVERFLOWS = [STORM_START <= s < STORM_START + STORM_STEPS for s in range(STORM_START + STORM_STEPS + STORM_AFTER)]
STORM_USED, STORM_AFTER_SCALES = _storm_scales(STORM_OVERFLOWS)
_STORM_BASE = {"model": "nanogpt_scheduled", "dataset": "repeated", "probe": "warnings"}
STORM = _scenario(
    "storm-2x2x2-zero1-16mixed",
    {**LAYOUT_3D, "zero_stage": 1},
    2,
    len(STORM_OVERFLOWS),
    **_STORM_BASE,
    model_kwargs={"storm_start": STORM_START, "storm_steps": STORM_STEPS, "storm_replica": 1},
    precision_plugin={"precision": "16-mixed", **STORM_SCALER},
)
STORM["model"] = "nanogpt_storm"
# the reference never has the storm: the same module, data and layout for the 3 + 4 real steps, with the loss scale
# the stormed run used at each of them (fp16 rounds differently at another scale)
STORM_REFERENCE = {
    **STORM,
    "name": "storm-reference-2x2x2-zero1-16mixed",
    "steps": STORM_START + STORM_AFTER,
    "model_kwargs": NANOGPT,
    "force_scales": STORM_USED[:STORM_START] + STORM_USED[STORM_START + STORM_STEPS :],
}
# the same storm with a limit: the fit ends cleanly after 3 overflowed steps in a row
STORM_STOP = {
    **STORM,
    "name": "storm-stop-2x2x2-zero1-16mixed",
    "precision_plugin": {**STORM["precision_plugin"], "max_consecutive_skipped_steps": STORM_STOP_AFTER},
}
WORLD8 = [*OVERFLOW, GROWTH, RESUME, *TINY, *MIXED, *STATE, CLIP_VALUE, STORM, STORM_REFERENCE, STORM_STOP]


share(8, WORLD8)  # launched with the other modules' 8-process scenarios


@pytest.fixture(scope="session")
def precision_group(shared_groups):
    return shared_groups(8)


@functools.cache
def _reference(name: str) -> dict[str, Any]:
    scenario = next(s for s in WORLD8 if s["name"] == name)
    reference = {**scenario, "trainer": {k: v for k, v in scenario.get("trainer", {}).items() if k != "precision"}}
    return run_reference(reference)


# ---------------------------------------------------------------------------------------------- overflow agreement
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", OVERFLOW, ids=[s["name"] for s in OVERFLOW])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(precision_group, scenario: dict[str, Any]) -> None:
    per_rank = precision_group.get(scenario["name"])["probe"]
    assert len(per_rank) == 8
    k = INJECT_STEP
    for rank, steps in enumerate(per_rank):
        before, skipped, after = steps[k - 1], steps[k], steps[k + 1]
        # weights and optimizer state (incl. fp32 masters) bitwise unchanged across the skipped step, on every rank
        assert skipped["params"] == before["params"], f"rank {rank}: parameters changed at the skipped step"
        assert skipped["optimizer"] == before["optimizer"], f"rank {rank}: optimizer state changed at the skip"
        # ... and training goes on afterwards
        assert after["params"] != skipped["params"], f"rank {rank}: parameters did not move after the skip"
        # hysteresis=1 is used up by one overflow: the scale halves, once
        assert skipped["scale"] == before["scale"] * 0.5 and after["scale"] == skipped["scale"], rank
        # the per-step LR scheduler holds still at the skipped step, then moves on
        assert skipped["scheduler_steps"] == before["scheduler_steps"], f"rank {rank}: LR scheduler advanced"
        assert skipped["lr"] == before["lr"] and after["lr"] < skipped["lr"], rank
        assert after["scheduler_steps"] == before["scheduler_steps"] + 1, rank
        assert [s["skipped"] for s in steps] == [0] * k + [1] * (len(steps) - k), f"rank {rank}: skipped count"
        assert skipped["grad_norm"] is None and after["grad_norm"] is not None and math.isfinite(after["grad_norm"])
    # every rank agrees on the scale at every step
    for step in range(len(per_rank[0])):
        assert len({steps[step]["scale"] for steps in per_rank}) == 1, f"ranks disagree on the scale at step {step}"


@pytest.mark.timeout(2400)
def test_loss_scale_grows_after_growth_interval_clean_steps_on_every_rank(precision_group) -> None:
    per_rank = precision_group.get(GROWTH["name"])["probe"]
    want = [256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]  # doubles after every 2nd clean step
    for rank, steps in enumerate(per_rank):
        assert [s["scale"] for s in steps] == want, f"rank {rank}"
        assert all(s["skipped"] == 0 for s in steps)


@pytest.mark.timeout(2400)
def test_resume_restores_the_loss_scaler_and_continues_exactly(precision_group) -> None:
    whole, resumed = precision_group.get(GROWTH["name"]), precision_group.get(RESUME["name"])
    k = RESUME["resume_after"]
    for rank, (before, after) in enumerate(zip(whole["probe"], resumed["probe"])):
        # the scale (512 at the save, grown once since) and its clean-step count come back from the checkpoint
        assert [s["scale"] for s in after] == [s["scale"] for s in before[k:]], f"rank {rank}"
    for step, (got, want) in enumerate(zip(resumed["losses"][k:], whole["losses"][k:]), start=k + 1):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: loss {got} after resume vs {want}"
    for name, want in whole["params"].items():
        assert relative_error(resumed["params"][name], want) <= 1e-6, name


# ---------------------------------------------------------------------------------------------- overflow storm
def _replica_of(rank: int) -> int:
    """The rank holding the same pipeline stage and tensor shard on the other data-parallel replica (2x2x2)."""
    return rank ^ 2  # rank = 4 x pipeline + 2 x data + tensor


@pytest.mark.timeout(2400)
def test_overflow_storm_keeps_weights_and_state_then_recovers(precision_group) -> None:
    """40 steps in a row overflow (fp16 logits to inf on one data replica); the scale reaches the floor after 10 of
    them and 30 more overflow there: no crash, one warning, nothing changes, and training then goes on as a run that
    never had the storm."""
    result = precision_group.get(STORM["name"])
    per_rank = result["probe"]
    k, n = STORM_START, STORM_STEPS
    assert len(per_rank) == 8
    losses = result["losses"]
    assert len(losses) == k + n + STORM_AFTER
    # the storm is real: the averaged loss of every storm step is inf/NaN, and only those
    assert all(not math.isfinite(loss) for loss in losses[k : k + n]), losses[k : k + n]
    assert all(math.isfinite(loss) for loss in losses[:k] + losses[k + n :])
    # 30 overflows at the minimum scale
    assert min(STORM_USED) == 1.0 and STORM_USED.count(1.0) >= STORM_STEPS - 10, STORM_USED
    for rank, steps in enumerate(per_rank):
        held = steps[k - 1]
        for step in range(k, k + n):
            record = steps[step]
            # weights and optimizer state (Adam moments, step counts, fp32 shard) bitwise as before the storm
            assert record["params"] == held["params"], f"rank {rank}: parameters changed at storm step {step}"
            assert record["optimizer"] == held["optimizer"], f"rank {rank}: optimizer state changed at step {step}"
            assert record["lr"] == held["lr"] and record["scheduler_steps"] == held["scheduler_steps"], (rank, step)
            assert record["skipped"] == step - k + 1, (rank, step)
            assert record["grad_norm"] is None
        # every rank follows the scaler's rules: back off to the floor, then grow back every 3 clean steps
        assert [s["scale"] for s in steps] == STORM_AFTER_SCALES, f"rank {rank}"
        assert steps[-1]["scale"] == 2.0 > 1.0
        # training goes on: every step after the storm moves the weights and the scheduler
        for step in range(k + n, k + n + STORM_AFTER):
            assert steps[step]["params"] != steps[step - 1]["params"], f"rank {rank}: step {step} did not apply"
            assert steps[step]["scheduler_steps"] == steps[step - 1]["scheduler_steps"] + 1, (rank, step)
        # the stormed replica did not drift from the other one
        assert [s["params"] for s in steps] == [s["params"] for s in per_rank[_replica_of(rank)]], rank
    # one warning, on rank 0, at the first overflow at the floor; none on the other ranks, no stop
    storm_warnings = [
        [(step, m) for step, s in enumerate(steps) for m in s["warnings"] if "loss scale" in m or "Stopping" in m]
        for steps in per_rank
    ]
    first_at_floor = STORM_USED.index(1.0)  # the first step that overflows with the scale already at the floor
    assert first_at_floor == k + 10, STORM_USED
    assert len(storm_warnings[0]) == 1 and storm_warnings[0][0][0] == first_at_floor, storm_warnings[0]
    message = storm_warnings[0][0][1]
    assert "minimum loss scale (1.0)" in message and "without a warning" in message, message
    assert "max_consecutive_skipped_steps" in message, message
    assert all(not w for w in storm_warnings[1:]), storm_warnings
    # ... as a run that never had the storm: the same losses before and after it, the same final weights
    reference = precision_group.get(STORM_REFERENCE["name"])
    expected = reference["losses"]
    got = losses[:k] + losses[k + n :]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
    assert worst <= 1e-6, f"losses differ from the storm-free run by {worst:.2e}: {got} vs {expected}"
    for name, want in reference["params"].items():
        assert relative_error(result["params"][name], want) <= 1e-6, name


@pytest.mark.timeout(2400)
def test_overflow_storm_stops_cleanly_after_max_consecutive_skipped_steps(precision_group) -> None:
    result = precision_group.get(STORM_STOP["name"])  # no error recorded: the fit returned
    k, limit = STORM_START, STORM_STOP_AFTER
    assert len(result["losses"]) == k + limit, result["losses"]
    for rank, steps in enumerate(result["probe"]):
        assert len(steps) == k + limit, f"rank {rank} ran {len(steps)} steps"  # every rank stopped at the same step
        assert steps[-1]["params"] == steps[k - 1]["params"] and steps[-1]["optimizer"] == steps[k - 1]["optimizer"]
        stops = [m for s in steps for m in s["warnings"] if m.startswith("Stopping training")]
        assert len(stops) == (1 if rank == 0 else 0), (rank, stops)
    stop = next(m for s in result["probe"][0] for m in s["warnings"] if m.startswith("Stopping training"))
    assert f"{limit} optimizer steps in a row overflowed" in stop, stop
    assert f"`max_consecutive_skipped_steps={limit}`" in stop and "None: never stop" in stop, stop


# ---------------------------------------------------------------------------------------------- fp32 master weights
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", TINY, ids=[s["name"] for s in TINY])
def test_bf16_true_accumulates_updates_below_bf16_resolution(precision_group, scenario: dict[str, Any]) -> None:
    # the claim being tested: in pure bf16 each update is rounded away
    pure = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(TINY_STEPS):
        pure -= TINY_LR
    assert torch.equal(pure, torch.ones(4, dtype=torch.bfloat16))
    result = precision_group.get(scenario["name"])
    weight = result["params"]["model.ln_f.weight"]
    assert weight.dtype == torch.bfloat16
    # the fp32 master took every step: 1 - 10 x 1e-3 = 0.99, and the bf16 parameter is its rounding (0.98828125)
    expected = torch.full(weight.shape, 1.0 - TINY_STEPS * TINY_LR).to(torch.bfloat16)
    assert torch.equal(weight, expected), f"{weight} vs {expected}"
    masters = [steps[-1]["ln_f_master"] for steps in result["probe"] if steps[-1]["ln_f_master"] is not None]
    assert masters and all(abs(m - (1.0 - TINY_STEPS * TINY_LR)) < 1e-6 for m in masters), masters
    assert not torch.equal(weight, torch.ones_like(weight))


# ---------------------------------------------------------------------------------------------- mixed vs fp32
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", MIXED, ids=[s["name"] for s in MIXED])
def test_mixed_precision_stays_within_two_percent_of_fp32(precision_group, scenario: dict[str, Any]) -> None:
    losses = precision_group.get(scenario["name"])["losses"]
    fp32 = _reference(scenario["name"])["losses"]
    assert len(losses) == len(fp32) == MIXED_STEPS
    assert fp32[-1] < 0.9 * fp32[0], "the fp32 run must actually learn for the comparison to mean something"
    worst = max(abs(a - b) / b for a, b in zip(losses, fp32))
    assert worst <= 0.02, f"{scenario['name']}: loss differs from fp32 by {worst:.2%} at worst"
    assert abs(losses[-1] - fp32[-1]) / fp32[-1] <= 0.02


# ---------------------------------------------------------------------------------------------- memory and clipping
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", [*STATE, *TINY], ids=[s["name"] for s in [*STATE, *TINY]])
def test_model_state_report_reflects_the_precision(precision_group, scenario: dict[str, Any]) -> None:
    result = precision_group.get(scenario["name"])
    layout = result["layout"]
    sgd = scenario["model"] == "nanogpt_tiny_updates"  # plain SGD keeps no state
    for rank, record in enumerate(result["per_rank"]):
        expected = expected_model_state_bytes(
            record["local_numel"],
            zero_stage=layout["zero_stage"],
            data_parallel_size=layout["data_parallel_size"],
            precision="bf16-true",
            optimizer_states=0 if sgd else 2,
        )
        for key, want in expected.items():
            got = record["model_state"][key]
            assert abs(got - want) <= 0.05 * want, f"rank {rank} {key}: measured {got}, formula {want}"


@pytest.mark.timeout(2400)
def test_value_clipping_matches_single_process(precision_group) -> None:
    assert_parity(precision_group.get(CLIP_VALUE["name"]), _reference(CLIP_VALUE["name"]))


# ---------------------------------------------------------------------------------------------- single process
def test_scaler_hysteresis_backoff_growth_and_floor() -> None:
    s = DynamicLossScaler(initial_scale=8.0, hysteresis=2, growth_interval=3, min_scale=2.0)
    s.update(found_inf=True)  # first overflow: hysteresis absorbs it
    assert (s.scale, s.skipped_steps) == (8.0, 1)
    s.update(found_inf=True)  # hysteresis used up: back off
    assert s.scale == 4.0
    s.update(found_inf=True)  # stays used up until the next growth
    assert s.scale == 2.0
    for _ in range(3):
        s.update(found_inf=False)
    assert (s.scale, s.hysteresis_left, s.skipped_steps) == (4.0, 2, 3)
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow resets the count of clean steps
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert s.scale == 4.0
    s.load_state_dict(DynamicLossScaler().state_dict())
    assert (s.scale, s.skipped_steps) == (2.0**16, 0)


def test_scaler_at_min_scale_warns_or_stops() -> None:
    s = DynamicLossScaler(initial_scale=1.0, hysteresis=1)
    with pytest.warns(RuntimeWarning, match="minimum loss scale"):
        s.update(found_inf=True)
    assert s.scale == 1.0 and s.skipped_steps == 1
    stop = DynamicLossScaler(initial_scale=1.0, hysteresis=1, on_min_scale="stop")
    with pytest.raises(LossScaleError, match="on_min_scale='warn'"):
        stop.update(found_inf=True)


def test_scaler_warns_once_per_storm_at_the_floor_and_asks_to_stop_after_the_limit() -> None:
    s = DynamicLossScaler(initial_scale=4.0, hysteresis=1, growth_interval=2, max_consecutive_skipped_steps=50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(49):  # 4 -> 2 -> 1, then 47 overflows at the floor
            s.update(found_inf=True)
    floor = [w for w in caught if "minimum loss scale" in str(w.message)]
    assert len(floor) == 1 and floor[0].category is RuntimeWarning, [str(w.message) for w in caught]
    assert "stops cleanly after 50 overflowed steps in a row" in str(floor[0].message)
    assert (s.scale, s.consecutive_skipped_steps, s.stop_requested) == (1.0, 49, False)
    s.update(found_inf=True)
    assert s.stop_requested and s.skipped_steps == 50
    s.update(found_inf=False)  # a clean step ends the run of skipped steps
    assert (s.consecutive_skipped_steps, s.stop_requested, s.skipped_steps) == (0, False, 50)
    restored = DynamicLossScaler()
    restored.load_state_dict({**s.state_dict(), "consecutive_skipped_steps": 7})
    assert restored.consecutive_skipped_steps == 7
    legacy = {k: v for k, v in s.state_dict().items() if k != "consecutive_skipped_steps"}
    restored.load_state_dict(legacy)  # a checkpoint written before the count existed
    assert restored.consecutive_skipped_steps == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.update(found_inf=True)  # still at the floor, not grown since: no second warning
        s.update(found_inf=False)
        s.update(found_inf=False)  # grown: the next storm at the floor warns again
        assert s.scale == 2.0
        s.update(found_inf=True)
        s.update(found_inf=True)
    assert len([w for w in caught if "minimum loss scale" in str(w.message)]) == 1
    never = DynamicLossScaler(initial_scale=1.0, hysteresis=1, max_consecutive_skipped_steps=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5000):
            never.update(found_inf=True)
    assert not never.stop_requested and len(caught) == 1 and "keeps skipping" in str(caught[0].message)


def test_scaler_unscales_and_flags_non_finite_gradients() -> None:
    s = DynamicLossScaler(initial_scale=4.0)
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0, dtype=torch.bfloat16)]
    assert s.unscale_(grads, torch.device("cpu")) is False
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [1.0] * 2
    assert s.unscale_([torch.tensor([1.0, float("nan")])], torch.device("cpu")) is True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "64-true"}, "not supported"),
        ({"initial_scale": 0.0}, r"`initial_scale=0.0`: pass a positive scale .* e.g. 2.0\*\*16"),
        ({"growth_factor": 1.0}, r"`growth_factor=1.0`: pass a factor above 1 .* e.g. 2.0"),
        ({"backoff_factor": 1.5}, r"`backoff_factor=1.5`: pass a factor between 0 and 1 .* e.g. 0.5"),
        ({"growth_interval": 0}, r"`growth_interval=0`: pass a positive integer.* e.g. 1000"),
        ({"growth_interval": 10.0}, r"`growth_interval=10.0`: pass a positive integer"),
        ({"hysteresis": 0}, r"`hysteresis=0`: pass a positive integer.* e.g. 2"),
        ({"min_scale": 8.0, "initial_scale": 4.0}, r"`min_scale=8.0`: pass a positive floor not above `initial_scale`"),
        ({"on_min_scale": "crash"}, r"`on_min_scale='crash'`: pass 'warn' .* or 'stop'"),
        ({"max_consecutive_skipped_steps": 0}, r"`max_consecutive_skipped_steps=0`: pass a positive integer.*or None"),
        ({"max_consecutive_skipped_steps": 2.5}, r"`max_consecutive_skipped_steps=2.5`: pass a positive integer"),
        ({"max_consecutive_skipped_steps": True}, r"`max_consecutive_skipped_steps=True`: pass a positive integer"),
    ],
)
def test_bad_precision_arguments_name_the_parameter_the_value_and_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(HybridConfigError, match=match):
        HybridPrecision(**{"precision": "16-mixed", **kwargs})
    if "precision" not in kwargs:  # the scaler itself refuses them the same way
        with pytest.raises(HybridConfigError, match=match):
            DynamicLossScaler(**kwargs)


def test_the_scaler_settings_are_defined_once_and_both_constructors_take_them() -> None:
    # the fields of LossScalerOptions are HybridPrecision's keyword-only arguments and DynamicLossScaler's arguments,
    # with their types and defaults (what jsonargparse reads for --help, type checks and YAML init_args)
    hints = typing.get_type_hints(LossScalerOptions)
    keyword_only, positional = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    for constructor, kind in ((HybridPrecision, keyword_only), (DynamicLossScaler, positional)):
        parameters, types = inspect.signature(constructor).parameters, typing.get_type_hints(constructor.__init__)
        for f in dataclasses.fields(LossScalerOptions):
            parameter = parameters[f.name]
            assert (parameter.default, parameter.kind, types[f.name]) == (f.default, kind, hints[f.name])
    assert list(inspect.signature(HybridPrecision).parameters)[:2] == ["precision", "device"]
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(HybridPrecision).parameters.values())
    with pytest.raises(TypeError, match=r"HybridPrecision.__init__\(\) got an unexpected keyword argument 'growth'"):
        HybridPrecision("bf16-mixed", growth=2.0)  # a misspelt setting is refused in every mode
    with pytest.raises(TypeError, match=r"DynamicLossScaler.__init__\(\) got an unexpected keyword argument 'growth'"):
        DynamicLossScaler(growth=2.0)
    scaler = HybridPrecision("16-mixed", growth_interval=7).scaler
    assert scaler is not None and (scaler.growth_interval, scaler.hysteresis) == (7, LossScalerOptions().hysteresis)
    assert DynamicLossScaler(8.0).scale == 8.0  # positionally, as before


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_trainer_precision_maps_to_hybrid_precision(precision: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False)
    plugin = HybridPrecision.from_lightning(trainer.precision_plugin)
    if precision == "16-mixed":  # Lightning's own fallback on CPU (with a warning); GPUs keep fp16
        assert isinstance(plugin, HybridPrecision) and plugin.precision == "bf16-mixed"
        plugin = HybridPrecision.from_lightning(MixedPrecision("16-mixed", "cuda", scaler=object()))
    assert isinstance(plugin, HybridPrecision) and plugin.precision == precision
    assert (plugin.loss_scale is not None) == precision.startswith("16")
    assert (plugin.master_dtype is not None) == (precision in ("bf16-true", "16-true"))
