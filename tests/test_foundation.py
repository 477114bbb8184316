"""Issue: foundation. Multi-process parity of TP and ZeRO against a single-process run of the same module, data, seed.

Two process groups are launched (2 and 4 CPU processes) and every scenario of that size runs inside them.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest

from lightning_hybrid.sharding import expected_model_state_bytes
from tests.conftest import keeps_its_groups, relative_error, share
from tests.harness import run_reference

STEPS = 6  # optimizer steps per parity scenario (resumed ones save after 3): docs/testing.md
BATCH = 4
TOL = 1e-5
BUCKET_MB = 0.01  # gradient buckets of ~10 KB: several per model in the bucket scenarios
PEAK_BUCKET_MB = 0.25
OVERFLOW_STEPS, OVERFLOW_AT = 5, 2
# nanoGPT without biases: the key bias has an exactly zero gradient (softmax is shift-invariant per query), so Adam
# turns rounding noise there into full-size steps and any change of summation order, even DDP's, shows up at 1e-4.
MODELS = {"nanogpt": {"bias": False}, "llama": {}}
# small enough that every step clamps some gradient elements and leaves others (checked in one process)
CLIP_VALUE = {"gradient_clip_val": 2e-3, "gradient_clip_algorithm": "value"}


def scenario(name: str, model: str, strategy: dict[str, Any], dp: int, **extra: Any) -> dict[str, Any]:
    kwargs = {**MODELS[model], **extra.pop("model_kwargs", {})}
    return {"name": name, "model": model, "model_kwargs": kwargs, "strategy": strategy, "steps": STEPS,
            "batch_size": BATCH, "data_parallel_size": dp, **extra}  # fmt: skip


WORLD2 = [
    *[scenario(f"{m}-dp2-zero{z}", m, {"zero_stage": z}, 2) for m in MODELS for z in (0, 1, 2, 3)],
    *[scenario(f"{m}-tp2", m, {"tensor_parallel_size": 2}, 1) for m in MODELS],
    *[scenario(f"{m}-tp2-sp", m, {"tensor_parallel_size": 2, "sequence_parallel": True}, 1) for m in MODELS],
    scenario("nanogpt-tp2-tied", "nanogpt", {"tensor_parallel_size": 2}, 1, model_kwargs={"tie_weights": True}),
    {**scenario("nanogpt-tp2-user-plan", "nanogpt", {"tensor_parallel_size": 2}, 1), "model": "nanogpt_user_tp"},
    scenario("nanogpt-dp2-zero1-ac", "nanogpt", {"zero_stage": 1, "activation_checkpointing": True}, 2),
    # the planner's top layout for docs/planning.md's 65B case (ZeRO-3 over every device, full recompute), CPU-sized
    scenario("llama-dp2-zero3-ac-full", "llama", {"zero_stage": 3, "activation_checkpointing": "full"}, 2),
    # op-level selective recompute (matmul, attention and collective outputs kept), under tensor parallel with
    # sequence parallel, and on every second block of a pipeline stage
    scenario("llama-tp2-sp-sac", "llama", {"tensor_parallel_size": 2, "sequence_parallel": True,
                                           "activation_checkpointing": "selective"}, 1),  # fmt: skip
    scenario("nanogpt-pp2-sac-every2", "nanogpt", {"pipeline_parallel_size": 2, "activation_checkpointing": "selective",
                                                   "activation_checkpointing_every": 2}, 1),  # fmt: skip
    scenario(
        "nanogpt-tp2-dictplan",
        "nanogpt",
        {
            "tensor_parallel_size": 2,
            "tensor_parallel_plan": {
                "model.h.*.attn.c_attn": "fused_colwise_3",
                "model.h.*.attn.c_proj": "rowwise",
                "model.h.*.mlp.c_fc": "colwise",
                "model.h.*.mlp.c_proj": "rowwise",
            },
        },
        1,
    ),  # fmt: skip
    # configuration errors: raised alike on every rank before any collective, so the group goes on
    scenario("error-world", "nanogpt", {"tensor_parallel_size": 4}, 1, expect_error=True),
    scenario(
        "error-heads",
        "nanogpt",
        {"tensor_parallel_size": 2},
        1,
        expect_error=True,
        model_kwargs={"n_head": 3, "n_embd": 48},
    ),  # fmt: skip
    # stop mid-epoch at step 3 (ModelCheckpoint), resume in a new Trainer to step 10: exact continuation
    scenario("nanogpt-dp2-zero3-resume", "nanogpt", {"zero_stage": 3}, 2, resume_after=3, batch_size=16),
    scenario("nanogpt-dp2-zero1-resume", "nanogpt", {"zero_stage": 1}, 2, resume_after=3, batch_size=16),
    scenario("nanogpt-dp2-zero3-uninterrupted", "nanogpt", {"zero_stage": 3}, 2, batch_size=16),
    # the same under tensor parallel: the fused q|k|v weight and its optimizer state go through the block view
    scenario("nanogpt-tp2-resume", "nanogpt", {"tensor_parallel_size": 2}, 1, resume_after=3, batch_size=16),
    scenario("nanogpt-tp2-uninterrupted", "nanogpt", {"tensor_parallel_size": 2}, 1, batch_size=16),
    # gradients clipped by the global norm (small enough to clip every step), ZeRO-2 over data
    scenario("nanogpt-dp2-zero2-clip", "nanogpt", {"zero_stage": 2}, 2, trainer={"gradient_clip_val": 0.05}),
    # clipping by value (elementwise, on each rank's part of the reduced gradients) in the layouts that clip by norm,
    # and at tp2, where tensor-parallel DTensor gradients sit beside the plain ones of the replicated norms
    scenario("nanogpt-dp2-zero2-clip-value", "nanogpt", {"zero_stage": 2}, 2, trainer=CLIP_VALUE),
    scenario("nanogpt-tp2-clip-value", "nanogpt", {"tensor_parallel_size": 2}, 1, trainer=CLIP_VALUE),
    scenario(
        "error-pattern",
        "nanogpt",
        {"tensor_parallel_size": 2, "tensor_parallel_plan": {"model.h.*.nope": "colwise"}},
        1,
        expect_error=True,
    ),  # fmt: skip
    # ZeRO-0 gradient buckets overlapped with backward: ~10 KB buckets (about a dozen for this model), two batches
    # accumulated per step (the first backward must only add into the buckets, the second reduces them)
    scenario("nanogpt-dp2-zero0-buckets-accum", "nanogpt", {"zero_stage": 0, "bucket_cap_mb": BUCKET_MB}, 2,
             trainer={"accumulate_grad_batches": 2}),
    # a parameter used on data rank 0 only and one used nowhere (tests/bucket_models.py)
    {**scenario("nanogpt-dp2-zero0-buckets-unused", "nanogpt", {"zero_stage": 0, "bucket_cap_mb": BUCKET_MB}, 2,
                trainer={"accumulate_grad_batches": 2}), "model": "nanogpt_unused"},
    # manual optimization: backward outside optimizer_step, so the buckets are all reduced at the step
    {**scenario("nanogpt-dp2-zero0-buckets-manual", "nanogpt", {"zero_stage": 0, "bucket_cap_mb": BUCKET_MB}, 2),
     "model": "nanogpt_manual"},
    # fp16 loss scaling on bucketed gradients: +inf written into rank 1's gradient after backward of step 2
    {**scenario("nanogpt-dp2-zero0-buckets-overflow", "nanogpt",
                {"zero_stage": 0, "bucket_cap_mb": BUCKET_MB, "track_gradient_norm": True}, 2, steps=OVERFLOW_STEPS,
                precision_plugin={"precision": "16-mixed", "hysteresis": 1, "initial_scale": 2.0**10},
                inject_inf={"step": OVERFLOW_AT, "rank": 1}, probe=True), "model": "nanogpt_scheduled"},
    # ZeRO-2: every backward pass reduces its buckets into the owners' shards (accumulation adds into the shard)
    # (its second optimizer step metered: the collectives each bucket costs)
    {**scenario("nanogpt-dp2-zero2-buckets-accum", "nanogpt", {"zero_stage": 2, "bucket_cap_mb": BUCKET_MB}, 2,
                trainer={"accumulate_grad_batches": 2}), "metered_step": 1},
    # a parameter used on data rank 0 only: rank 1 holds its bucket (and the later ones) back until backward ends
    {**scenario("nanogpt-dp2-zero2-buckets-gated", "nanogpt", {"zero_stage": 2, "bucket_cap_mb": BUCKET_MB}, 2,
                trainer={"accumulate_grad_batches": 2}), "model": "nanogpt_gated"},
    {**scenario("nanogpt-dp2-zero2-buckets-manual", "nanogpt", {"zero_stage": 2, "bucket_cap_mb": BUCKET_MB}, 2),
     "model": "nanogpt_manual"},
    {**scenario("nanogpt-dp2-zero2-buckets-overflow", "nanogpt",
                {"zero_stage": 2, "bucket_cap_mb": BUCKET_MB, "track_gradient_norm": True}, 2, steps=OVERFLOW_STEPS,
                precision_plugin={"precision": "16-mixed", "hysteresis": 1, "initial_scale": 2.0**10},
                inject_inf={"step": OVERFLOW_AT, "rank": 1}, probe=True), "model": "nanogpt_scheduled"},
    # peak gradient memory during backward + reduction (tests/bucket_models.py PeakGradientBytes): a nanoGPT whose
    # weights dwarf its activations (batch 1), buckets of ~0.25 MiB, two micro-batches per step
    *[scenario(f"nanogpt-dp2-zero{z}-peak", "nanogpt", {"zero_stage": z, "bucket_cap_mb": PEAK_BUCKET_MB}, 2,
               steps=3, batch_size=1, trainer={"accumulate_grad_batches": 2}, peak_memory=True,
               model_kwargs={"n_embd": 128, "n_layer": 8}) for z in (0, 2)],
]  # fmt: skip
WORLD4 = [
    *[
        scenario(f"{m}-tp2-dp2-zero{z}", m, {"tensor_parallel_size": 2, "zero_stage": z}, 2)
        for m in MODELS
        for z in (1, 3)
    ],
    *[scenario(f"{m}-tp4", m, {"tensor_parallel_size": 4}, 1) for m in MODELS],
    # sequence parallel over data parallel: each ZeRO stage once, the two models alternating
    *[scenario(f"{m}-tp2-dp2-sp-zero{z}", m, {"tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": z}, 2)
      for m, z in (("nanogpt", 0), ("llama", 1), ("nanogpt", 2), ("llama", 3))],
    *[
        scenario(
            f"nanogpt-tp2-dp2-zero{z}-clip",
            "nanogpt",
            {"tensor_parallel_size": 2, "zero_stage": z},
            2,
            trainer={"gradient_clip_val": 0.05},
        )  # fmt: skip
        for z in (3, 0)
    ],
    *[scenario(f"nanogpt-tp2-dp2-zero{z}-clip-value", "nanogpt", {"tensor_parallel_size": 2, "zero_stage": z}, 2,
               trainer=CLIP_VALUE) for z in (3, 0)],
    # buckets of DTensor (tensor-parallel) gradients, with accumulation
    *[scenario(f"nanogpt-tp2-dp2-zero{z}-buckets-accum", "nanogpt",
               {"tensor_parallel_size": 2, "zero_stage": z, "bucket_cap_mb": BUCKET_MB}, 2,
               trainer={"accumulate_grad_batches": 2}) for z in (0, 2)],
]  # fmt: skip
# fp16 runs are not compared with the fp32 single-process run; the peak-memory runs are measured only
PARITY = [
    s
    for s in WORLD2 + WORLD4
    if not s.get("expect_error") and not s.get("precision_plugin") and not s.get("peak_memory")
]


share(2, WORLD2)
share(4, WORLD4)


@pytest.fixture(scope="session")
def group2(shared_groups):
    return shared_groups(2)


@pytest.fixture(scope="session")
def group4(shared_groups):
    return shared_groups(4)


@functools.cache
def reference(model: str, model_kwargs: tuple, dp: int, trainer: tuple = (), batch_size: int = BATCH) -> dict[str, Any]:
    return run_reference({"model": model, "model_kwargs": dict(model_kwargs), "data_parallel_size": dp,
                          "batch_size": batch_size, "steps": STEPS, "trainer": dict(trainer)})  # fmt: skip


def _result_and_reference(request: pytest.FixtureRequest, scenario: dict[str, Any]):
    group = request.getfixturevalue("group2" if scenario in WORLD2 else "group4")
    result = group.get(scenario["name"])
    return result, reference_for(scenario)


def reference_for(scenario: dict[str, Any]) -> dict[str, Any]:
    ref = reference(
        "nanogpt" if scenario["model"] == "nanogpt_user_tp" else scenario["model"],
        tuple(sorted(scenario["model_kwargs"].items())),
        scenario["data_parallel_size"],
        tuple(sorted(scenario.get("trainer", {}).items())),
        scenario["batch_size"],
    )
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in ref.items()}


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", PARITY, ids=[s["name"] for s in PARITY])
def test_parity_with_single_process(request: pytest.FixtureRequest, scenario: dict[str, Any]) -> None:
    result, reference = _result_and_reference(request, scenario)
    assert_parity(result, reference, batches_per_step=scenario.get("trainer", {}).get("accumulate_grad_batches", 1))


def assert_parity(
    result: dict[str, Any], reference: dict[str, Any], tied: dict[str, str] | None = None, batches_per_step: int = 1
) -> None:
    """Per-batch loss, final parameters and first-step gradients within TOL of the single-process run.

    ``tied`` maps a name that exists only in the parallel run (a tied weight's second copy on another pipeline
    stage) to the name of the weight it must still equal. ``batches_per_step``: Lightning's accumulate_grad_batches
    (one loss per batch)."""
    for extra, partner in (tied or {}).items():
        assert relative_error(result["params"].pop(extra), reference["params"][partner]) <= TOL, f"{extra} untied"
        result["grads"].pop(extra, None)
    assert len(result["losses"]) == len(reference["losses"]) == STEPS * batches_per_step
    if reference.get("norms") and result.get("norms"):
        # the global gradient norm used for clipping, each step, equals the single-device norm
        assert len(result["norms"]) == len(reference["norms"]) == STEPS
        for step, (got, want) in enumerate(zip(result["norms"], reference["norms"])):
            assert abs(got - want) / want <= TOL, f"step {step}: gradient norm {got} vs single-process {want}"
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} vs single-process {want}"
    assert result["params"].keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        err = relative_error(result["params"][name], want)
        assert err <= TOL, f"final parameter {name}: relative error {err:.2e}"
    # every parameter's first-step gradient, gathered over TP/ZeRO shards, is the single-process gradient
    assert result["grads"].keys() == reference["grads"].keys()
    for name, want in reference["grads"].items():
        err = relative_error(result["grads"][name], want)
        assert err <= TOL, f"gradient of {name} after step 1: relative error {err:.2e}"


RESUME_RTOL = 1e-6


def assert_resume_is_exact(resumed: dict[str, Any], whole: dict[str, Any], after: int) -> None:
    """The run stopped after step ``after`` and resumed equals the same run never stopped (same layout): every loss
    after the stop and every final parameter within RESUME_RTOL relative."""
    assert len(resumed["losses"]) == len(whole["losses"])
    for step, (got, want) in enumerate(zip(resumed["losses"], whole["losses"]), start=1):
        if step > after:
            assert abs(got - want) <= RESUME_RTOL * abs(want), f"step {step}: loss {got} resumed vs {want}"
    for name, want in whole["params"].items():
        err = relative_error(resumed["params"][name], want)
        assert err <= RESUME_RTOL, f"final parameter {name}: relative error {err:.2e} resumed vs uninterrupted"


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(
    ("resumed", "whole"),
    [(f"nanogpt-{layout}-resume", f"nanogpt-{layout}-uninterrupted") for layout in ("dp2-zero3", "tp2")],
    ids=["dp2-zero3", "tp2"],
)
def test_resume_equals_the_uninterrupted_run(group2, resumed: str, whole: str) -> None:
    assert_resume_is_exact(group2.get(resumed), group2.get(whole), after=3)


ZERO_REPORT = [s for s in PARITY if "zero" in s["name"] and "-ac" not in s["name"]]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", ZERO_REPORT, ids=[s["name"] for s in ZERO_REPORT])
def test_model_state_report_matches_zero_formula(request: pytest.FixtureRequest, scenario: dict[str, Any]) -> None:
    result, _ = _result_and_reference(request, scenario)
    layout = result["layout"]
    for rank, record in enumerate(result["per_rank"]):
        expected = expected_model_state_bytes(
            record["local_numel"], zero_stage=layout["zero_stage"], data_parallel_size=layout["data_parallel_size"]
        )
        measured = record["model_state"]
        for key, want in expected.items():
            assert abs(measured[key] - want) <= 0.05 * want, (
                f"rank {rank} {key}: measured {measured[key]}, formula {want}"
            )


def test_sampler_splits_data_over_data_parallel_only(group4) -> None:
    result = group4.get("nanogpt-tp2-dp2-zero1")
    samples = [r["sampler"] for r in result["per_rank"]]
    # ranks are (pipeline, data, tensor) with tensor fastest: 0,1 are replica 0; 2,3 replica 1
    assert samples[0] == samples[1] and samples[2] == samples[3], "tensor-parallel peers must see identical samples"
    assert not set(samples[0]) & set(samples[2]), "data-parallel replicas must see disjoint samples"
    assert sorted(samples[0] + samples[2]) == list(range(256)), "every sample once per epoch"


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("error-world", r"world size \(2\) is not divisible by tensor_parallel_size"),
        ("error-heads", r"tensor_parallel_size=2` does not divide .*n_head=3"),
        ("error-pattern", r"pattern 'model.h.\*.nope' matches no module"),
    ],
)
def test_bad_configuration_raises_on_every_rank(group2, name: str, match: str) -> None:
    import re

    messages = group2.expected_errors(name)
    assert len(messages) == 2, f"expected the error on both ranks, got {messages}\n{group2.log[-3000:]}"
    for message in messages:
        assert message.startswith("HybridConfigError") and re.search(match, message), message


BUCKETED = [s for s in WORLD2 + WORLD4 if "-buckets-" in s["name"]]


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("scenario", BUCKETED, ids=[s["name"] for s in BUCKETED])
def test_gradient_buckets_reduce_during_backward(request: pytest.FixtureRequest, scenario: dict[str, Any]) -> None:
    """Parity is checked above; here: several buckets, each reduced exactly once per optimizer step at ZeRO-0 (never
    for an accumulation batch) and once per backward pass at ZeRO-2 (accumulation adds into the shard), and some of
    them started from a gradient hook while backward was still running (automatic optimization; at ZeRO-2 also
    manual, since every backward pass reduces)."""
    result, _ = _result_and_reference(request, scenario)
    zero2 = scenario["strategy"]["zero_stage"] == 2
    passes = scenario["steps"] * (scenario.get("trainer", {}).get("accumulate_grad_batches", 1) if zero2 else 1)
    started_in_backward = []
    for rank, record in enumerate(result["per_rank"]):
        (buckets,) = record["gradient_buckets"]  # one optimizer
        assert len(buckets) >= 4, f"rank {rank}: {buckets}"
        assert all(b["launches"] == passes for b in buckets), f"rank {rank}: {buckets}"
        if scenario["model"] == "nanogpt_manual" and not zero2:
            # manual optimization: backward runs before optimizer.step(), the buckets are reduced in the step
            assert all(b["in_backward"] == 0 for b in buckets), f"rank {rank}: {buckets}"
            continue
        # the last layers' gradients come first in backward: their bucket completes and starts at once every pass
        assert buckets[0]["in_backward"] == passes, f"rank {rank}: {buckets}"
        started_in_backward.append([b["in_backward"] for b in buckets])
    if "metered_step" in scenario:
        # one reduce-scatter per bucket and backward pass (each owner its piece), no reduce per owner; the step's
        # parameter all-gather is one more data-parallel collective
        accumulated = scenario["trainer"]["accumulate_grad_batches"]
        for rank, record in enumerate(result["per_rank"]):
            calls = record["metered_calls"]
            (buckets,) = record["gradient_buckets"]
            assert calls.get("data/reduce_scatter") == len(buckets) * accumulated, (rank, calls, len(buckets))
            assert "data/reduce" not in calls, (rank, calls)
    if scenario["model"] == "nanogpt_unused":
        # `unused` (in model.h[0]) never reports, so its bucket and every later one start when backward ends, on
        # every rank
        assert all(counts[-1] == 0 for counts in started_in_backward), started_in_backward
    if scenario["model"] in ("nanogpt_unused", "nanogpt_gated"):
        # `gated` (model.h[1]) reports on rank 0 only, so rank 1 starts fewer buckets early, and rank 0's early ones
        # match rank 1's late ones (the losses above would hang or differ otherwise)
        assert sum(started_in_backward[0]) > sum(started_in_backward[1]), started_in_backward


PEAK = [s for s in WORLD2 if s.get("peak_memory")]


@pytest.mark.timeout(2400)
def test_zero2_peak_gradient_memory_is_a_shard_plus_the_buckets_in_flight(group2) -> None:
    """The high point of live gradient bytes during each step's two backward passes and the reduction (measured by
    PeakGradientBytes, which counts every tensor written in that window), on every rank.

    ZeRO-2 holds at most its shard (1/dp of the gradient) plus the buckets in use: MAX_IN_FLIGHT buckets being
    reduced, the one filling, and autograd's gradient of the parameter being added (freed by its hook), each at most
    the largest bucket. The bound below is that, plus 10% of the full gradient for the second micro-batch's
    activations and the activation gradients. ZeRO-0 (the same buckets,
    all-reduced) holds the full gradient, which checks that the probe sees gradient memory at all; the code before
    this ZeRO-2 path held the full gradient plus a flat copy of it (about 2.5x the full gradient at dp=2)."""
    from lightning_hybrid.sharding import ShardedGradientBuckets

    zero0, zero2 = (group2.get(s["name"]) for s in PEAK)
    dp = zero2["layout"]["data_parallel_size"]
    for rank, (record0, record2) in enumerate(zip(zero0["per_rank"], zero2["per_rank"])):
        full = 4 * record2["local_numel"]  # fp32 gradient of every parameter
        (buckets,) = record2["gradient_buckets"]
        largest = max((b["bytes"] for b in buckets), default=0)
        bound = full / dp + (ShardedGradientBuckets.MAX_IN_FLIGHT + 2) * largest + 0.1 * full
        peaks0, peaks2 = record0["peak_gradient_bytes"], record2["peak_gradient_bytes"]
        assert len(peaks2) == len(peaks0) == PEAK[1]["steps"], (peaks0, peaks2)
        assert min(peaks0) >= full, f"rank {rank}: ZeRO-0 peak {peaks0} below the full gradient {full}"
        assert max(peaks2) <= bound, (
            f"rank {rank}: ZeRO-2 peak gradient bytes {peaks2}, bound {bound:.0f} (full gradient {full}, dp {dp},"
            f" largest bucket {largest})"
        )
        assert bound < full, f"the bound {bound:.0f} must be below the full gradient {full} to mean anything"


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("stage", [0, 2])
def test_overflow_in_bucketed_gradients_skips_the_step_on_every_rank(group2, stage: int) -> None:
    """fp16 loss scaling with ZeRO-0 buckets (ZeRO-2: the shard backward reduced into): the overflow written into one
    rank's (already reduced) gradients is agreed on by both ranks, the step is skipped (parameters and optimizer
    state unchanged, gradients discarded), the scale halves, and training goes on from fresh gradients."""
    per_rank = group2.get(f"nanogpt-dp2-zero{stage}-buckets-overflow")["probe"]
    assert len(per_rank) == 2
    k = OVERFLOW_AT
    for rank, steps in enumerate(per_rank):
        assert len(steps) == OVERFLOW_STEPS
        before, skipped, after = steps[k - 1], steps[k], steps[k + 1]
        assert skipped["params"] == before["params"], f"rank {rank}: parameters changed at the skipped step"
        assert skipped["optimizer"] == before["optimizer"], f"rank {rank}: optimizer state changed at the skip"
        assert after["params"] != skipped["params"], f"rank {rank}: parameters did not move after the skip"
        assert skipped["scale"] == before["scale"] * 0.5 and after["scale"] == skipped["scale"], rank
        assert [s["skipped"] for s in steps] == [0] * k + [1] * (len(steps) - k), f"rank {rank}: skipped count"
        assert skipped["grad_norm"] is None and after["grad_norm"] is not None and math.isfinite(after["grad_norm"])
    # replicas stay identical: same parameters on both ranks after every step
    assert [s["params"] for s in per_rank[0]] == [s["params"] for s in per_rank[1]]


def test_finished_fits_leave_no_process_group_alive_once_dropped(group4) -> None:
    """A process that fits again and again (a notebook, a sweep, this launch) must not keep each fit's process groups:
    once a fit ends and its trainer and module are dropped, the worker destroys the groups the fit made, and they
    must then be freed, each with its gloo threads. Before, every fit's parameters kept gradient hooks, which autograd
    holds from C++, out of the garbage collector's reach; through them the fit's buckets, mesh and groups stayed
    alive: 9 threads a rank after every data-parallel fit, and each later scenario here cost up to 1.8x the CPU. The
    launch's own rank-0 timings record the threads alive after each scenario (the runs ordered last are known to
    keep theirs: see ``tests/conftest.py``)."""
    rows = [line.split("\t") for line in (group4.out_dir / "timings.rank0.tsv").read_text().splitlines()[2:]]
    spec = {s["name"]: s for s in json.loads((group4.out_dir / "spec.json").read_text())}
    fits = [(name, int(threads)) for name, _, _, threads, _ in rows if not keeps_its_groups(spec[name])]
    assert len(fits) >= 5, fits
    first = fits[0][1]  # the default group's threads and the first fit's groups kept for reuse by design
    grown = [(name, threads) for name, threads in fits if threads > first + 3]
    assert not grown, f"threads alive after a scenario grew from {first}: {grown[:5]}"
