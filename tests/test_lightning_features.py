"""Issue: Lightning features under every layout. torchmetrics objects and ``MetricCollection`` logged in training and
validation, ``self.log`` with every ``reduce_fx`` and ``sync_dist``, ``accumulate_grad_batches=2`` with a per-step LR
scheduler, validation during the fit, then ``trainer.validate``, ``trainer.test`` and ``trainer.predict``: each layout
against Lightning's own ``"ddp"`` with the same data-parallel size on the same data (Lightning gives every distributed
strategy a shuffling ``DistributedSampler``, so ``"ddp"`` is the truth, not one device). The scenarios run in the
shared launches of 2, 4 and 8 processes (tests/features.py); docs/lightning-features.md holds the matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from tests.conftest import launched, relative_error, share

TOLERANCE = 1e-5
_NO_MONITOR = {"monitor": False}  # the strategy's own monitor logs more names than "ddp" does


def _case(name: str, world: int, strategy: Any) -> dict[str, Any]:
    return {"name": f"features-{name}", "runner": "features", "strategy": strategy, "world": world, "timeout_s": 600}


REFERENCE = _case("ddp-dp2", 2, "ddp")
# "ddp" with each of a pipeline's two micro-batches as a batch: what a pipeline logs once per micro-batch (a
# reduce_fx of sum, max or min) is that run's (docs/step-semantics.md#logging)
MICROBATCH_REFERENCE = {**_case("ddp-dp2-mb2", 2, "ddp"), "microbatches": 2}
PER_MICROBATCH = ("_sum", "_max", "_min")
LAYOUTS = [
    _case("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _case("tp2-dp2", 4, {"tensor_parallel_size": 2, **_NO_MONITOR}),
    _case(
        "pp2-dp2-1f1b",
        4,
        {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b", "num_microbatches": 2, **_NO_MONITOR},
    ),
    _case(
        "pp2-dp2-interleaved",
        4,
        {
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_pipeline_size": 2,
            "num_microbatches": 2,
            **_NO_MONITOR,
        },
    ),
    _case(
        "2x2x2",
        8,
        {
            "pipeline_parallel_size": 2,
            "tensor_parallel_size": 2,
            "pipeline_schedule": "1f1b",
            "num_microbatches": 2,
            **_NO_MONITOR,
        },
    ),
    _case(
        "2x2x2-sp-zero3",
        8,
        {
            "pipeline_parallel_size": 2,
            "tensor_parallel_size": 2,
            "sequence_parallel": True,
            "zero_stage": 3,
            "pipeline_schedule": "1f1b",
            "num_microbatches": 2,
            **_NO_MONITOR,
        },
    ),
]
share(2, [REFERENCE, MICROBATCH_REFERENCE])
for _world in (2, 4, 8):
    share(_world, [c for c in LAYOUTS if c["world"] == _world])


def _expected(want: dict[str, float], per_microbatch: Optional[dict[str, float]]) -> dict[str, float]:
    """``want`` (the reference's values), with the names a pipeline logs once per micro-batch taken from
    ``per_microbatch`` (the micro-batch reference's: None without a pipeline)."""
    if per_microbatch is None:
        return want
    return {k: per_microbatch[k] if any(p in k for p in PER_MICROBATCH) else v for k, v in want.items()}


def _assert_values_equal(got: dict[str, float], want: dict[str, float], where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: logged names differ: {sorted(set(got) ^ set(want))}"
    for key, value in want.items():
        error = abs(got[key] - value) / max(abs(value), 1e-12)
        assert error <= TOLERANCE, f"{where}: {key} = {got[key]} vs ddp's {value} (relative error {error:.1e})"


@pytest.mark.parametrize("case", LAYOUTS, ids=[c["name"] for c in LAYOUTS])
def test_features_equal_ddp(shared_groups, case: dict[str, Any]) -> None:
    """Every rank of the layout logs, returns and predicts what the ``"ddp"`` rank with its data-parallel index does:
    each row the logger received (step values, epoch values of the metric objects and of every ``reduce_fx``), the
    callback metrics after the fit, what ``validate`` and ``test`` return, and the predictions (each rank its own
    share, as ``"ddp"`` returns them); and the trained weights (accumulation and the per-step scheduler) agree.
    Each rank's evaluation data ends with a batch of one sample: fewer micro-batches than pipeline stages."""
    pipelined = isinstance(case["strategy"], dict) and case["strategy"].get("pipeline_parallel_size", 1) > 1
    needed = [REFERENCE["name"]] + ([MICROBATCH_REFERENCE["name"]] if pipelined else [])
    if not all(launched(name) for name in needed):
        pytest.skip("the ddp references are not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(REFERENCE["name"])["per_rank"]
    by_microbatch = shared_groups(2).get(MICROBATCH_REFERENCE["name"])["per_rank"] if pipelined else None
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    assert len(result) == case["world"]
    for rank, got in enumerate(result):
        want = reference[got["data_rank"]]
        per_mb = by_microbatch[got["data_rank"]] if by_microbatch is not None else None
        where = f"{case['name']} rank {rank}"
        assert [step for step, _ in got["rows"]] == [step for step, _ in want["rows"]], f"{where}: logged steps"
        mb_rows = per_mb["rows"] if per_mb is not None else [(None, None)] * len(want["rows"])
        for (step, row), (_, expected), (_, mb_row) in zip(got["rows"], want["rows"], mb_rows):
            _assert_values_equal(row, _expected(expected, mb_row), f"{where}, logged at step {step}")
        fit = _expected(want["fit_metrics"], per_mb["fit_metrics"] if per_mb else None)
        _assert_values_equal(got["fit_metrics"], fit, f"{where}, callback metrics after fit")
        for kind in ("validated", "tested"):
            assert len(got[kind]) == len(want[kind]) == 1, f"{where}: {kind}"
            expected = _expected(want[kind][0], per_mb[kind][0] if per_mb else None)
            _assert_values_equal(got[kind][0], expected, f"{where}, trainer.{kind[:-2]}e")
        assert torch.equal(got["predictions"], want["predictions"]), f"{where}: predictions differ from ddp's"
    # each rank holds its stages' parameters (full tensors): together, the whole network
    params = {name: p for got in result for name, p in got["params"].items()}
    expected = reference[0]["params"]
    assert params.keys() == expected.keys()
    for name, want in expected.items():
        error = relative_error(params[name], want)
        assert error <= TOLERANCE, f"{case['name']}: parameter {name} relative error {error:.1e}"


def test_reference_logs_what_the_matrix_compares(shared_groups) -> None:
    """The ``"ddp"`` run logs every kind of value the matrix claims (so a missing name cannot pass unnoticed): the
    metric objects' step and epoch values, the collection's, every ``reduce_fx``, in training and validation."""
    if not launched(REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(REFERENCE["name"])["per_rank"]
    names = set().union(*(row.keys() for _, row in reference[0]["rows"]))
    wanted = {"train_acc_step", "train_acc_epoch", "train_correct", "train_loss_mean_metric_epoch", "val_acc",
              "val_macro_acc", "val_correct", "test_loss", "test_loss_max"}  # fmt: skip
    wanted |= {f"train_loss_{fx}_{when}" for fx in ("sum", "mean", "max", "min") for when in ("step", "epoch")}
    wanted |= {f"val_loss_{fx}" for fx in ("sum", "mean", "max", "min")}
    wanted |= {"grad_2.0_norm_total", "grad_2.0_norm/model.wte.weight", "grad_2.0_norm/model.lm_head.weight"}
    assert wanted <= names, sorted(wanted - names)
    assert len({tuple(r["predictions"].flatten().tolist()) for r in reference}) == 2  # each rank its own share


def _stages(make: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any]:
    """The same metrics on a 'last stage' and an 'other stage' module, with their mirrors (one process)."""
    from lightning_hybrid.monitoring.metrics import MetricMirror

    last, other = torch.nn.Module(), torch.nn.Module()
    last.metric, other.metric = make(), make()
    return last, other, MetricMirror(last), MetricMirror(other)


def _metric_cases() -> list[tuple[Any, Any]]:
    """(make the metric, make one micro-batch's update arguments) per kind of state."""
    import torchmetrics

    scores = lambda: (torch.rand(4), torch.randint(0, 2, (4,)))  # noqa: E731
    return [
        (torchmetrics.MeanMetric, lambda: (torch.rand(4),)),  # sum states with a weight
        (torchmetrics.classification.BinaryAUROC, scores),  # list ("cat") states
        (torchmetrics.MaxMetric, lambda: (torch.rand(4),)),  # full_state_update=True: the whole state is sent
        (
            lambda: torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="macro"),
            lambda: (torch.rand(4, 3), torch.randint(0, 3, (4,))),
        ),
    ]


@pytest.mark.parametrize("index", range(4), ids=["mean", "cat", "full-state", "accuracy"])
def test_metric_mirror_matches_one_metric_fed_every_batch(index: int) -> None:
    """Three steps of two micro-batches through the mirror: the last stage's and the other stage's metric both end
    with the state and value of one metric fed the same six batches, and each step's value (``_forward_cache``) is
    that of one metric fed the step's two micro-batches, as a data-parallel rank's forward over the batch gives (but
    for a metric updated in place, whose step value is its last micro-batch's)."""
    make, arguments = _metric_cases()[index]
    torch.manual_seed(0)
    last, other, sender, receiver = _stages(make)
    whole = make()
    for step in range(3):
        microbatches = [arguments() for _ in range(2)]
        sender.begin()
        for args in microbatches:
            last.metric(*args)
        sent = sender.end()
        receiver.apply(sent)
        one_step = make()
        for args in microbatches:
            one_step.update(*args)
            whole.update(*args)
        for metric in (last.metric, other.metric):
            assert torch.allclose(metric.compute(), whole.compute()), step
            if "added" in sent["metric"]:  # merged, not updated in place
                assert torch.allclose(metric._forward_cache, one_step.compute()), step
        assert torch.equal(last.metric._forward_cache, other.metric._forward_cache)
    assert other.metric._update_count == last.metric._update_count == 6


def test_metric_mirror_leaves_unused_metrics_and_checks_untouched() -> None:
    """A metric the step does not update is not sent and keeps its state; ``unchanged`` undoes a check's updates."""
    import torchmetrics

    last, _, sender, _ = _stages(torchmetrics.SumMetric)
    last.metric.update(torch.tensor(2.0))
    sender.begin()
    assert sender.end() == {}
    assert float(last.metric.compute()) == 2.0 and last.metric._update_count == 1
    with sender.unchanged():
        last.metric.update(torch.tensor(5.0))
    assert float(last.metric.compute()) == 2.0 and last.metric._update_count == 1


def test_lightning_grad_norm_named_by_a_module_or_callback_is_refused_where_it_differs_from_ddp() -> None:
    """The set-up check reads the names the user's methods refer to: Lightning's ``grad_norm`` imported (or under
    another name, or as an attribute of a Lightning module, or inside a lambda) is refused wherever a rank does not
    hold every gradient whole in ``p.grad``; ``lightning_hybrid.grad_norm`` never is; a call through a function
    outside the user's classes is not seen (it fails at the first step instead: the scenario above)."""
    from types import SimpleNamespace

    import lightning.pytorch.utilities as utilities
    from lightning.pytorch.utilities import grad_norm as renamed

    from lightning_hybrid import HybridConfigError
    from lightning_hybrid.monitoring.gradients import check_gradient_norm_hooks
    from tests.features import FeatureGPT, HiddenLightningNormsGPT, LightningNormsGPT

    class ByAttribute:
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            module.log_dict(utilities.grad_norm(module, norm_type=2))

    class InALambda:
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            norms = lambda: renamed(module, 2)  # noqa: E731
            module.log_dict(norms())

    def layout(tp: int = 1, pp: int = 1, zero: int = 0) -> Any:
        return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, zero_stage=zero,
                               expert_parallel_size=1, context_parallel_size=1)  # fmt: skip

    def holder(cls: type, callbacks: tuple = ()) -> Any:
        module = cls.__new__(cls)  # the check reads the class and the trainer's callbacks only
        module.__dict__["_trainer"] = SimpleNamespace(callbacks=list(callbacks))
        return module

    split = [layout(tp=2), layout(pp=2), layout(zero=1), layout(zero=3)]
    refused_holders = [LightningNormsGPT, holder(FeatureGPT, (ByAttribute(),)), holder(FeatureGPT, (InALambda(),))]
    for refused in (holder(refused_holders[0]), *refused_holders[1:]):
        for each in split:
            with pytest.raises(HybridConfigError, match="from lightning_hybrid import grad_norm"):
                check_gradient_norm_hooks(refused, each, master_weights=False)
        check_gradient_norm_hooks(refused, layout(), master_weights=False)  # every gradient whole: as ddp
        with pytest.raises(HybridConfigError, match="LightningNormsGPT|ByAttribute|InALambda"):
            check_gradient_norm_hooks(refused, layout(), master_weights=True)
    for allowed in (holder(FeatureGPT), holder(HiddenLightningNormsGPT)):
        for each in split:
            check_gradient_norm_hooks(allowed, each, master_weights=False)


# ---------------------------------------------------------------------------------------------------------------
# Loops, callbacks, loggers and hooks (tests/features.py: LoopGPT, run_loops), and manual optimization (ManualGPT)


def _loops(name: str, world: int, strategy: Any, **extra: Any) -> dict[str, Any]:
    return {**_case(f"loops-{name}", world, strategy), "runner": "feature_loops", **extra}


def _data(name: str, world: int, strategy: Any) -> dict[str, Any]:
    return {**_case(f"data-{name}", world, strategy), "runner": "feature_data"}


def _manual(name: str, world: int, strategy: Any, **extra: Any) -> dict[str, Any]:
    return {**_case(f"manual-{name}", world, strategy), "runner": "feature_manual", **extra}


_PP2 = {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b", "num_microbatches": 2}
_3D = {**_PP2, "tensor_parallel_size": 2}
LOOPS_REFERENCE = _loops("ddp-dp2", 2, "ddp")
LOOPS = [
    _loops("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _loops("dp2-zero1", 2, {"zero_stage": 1, **_NO_MONITOR}),
    _loops("tp2-dp2", 4, {"tensor_parallel_size": 2, **_NO_MONITOR}),
    _loops("pp2-dp2-1f1b", 4, {**_PP2, **_NO_MONITOR}),
    _loops(
        "pp2-dp2-interleaved",
        4,
        {**_PP2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2, **_NO_MONITOR},
    ),
    _loops("2x2x2", 8, {**_3D, **_NO_MONITOR}),
]
LOOPS_REFUSED = [  # a sampler sharded by global rank gives tensor and pipeline peers different batches
    _loops(
        "tp2-dp2-world-sampler",
        4,
        {"tensor_parallel_size": 2, **_NO_MONITOR},
        sharded_by="world",
        expect_error=True,
    ),
    _loops("pp2-dp2-world-sampler", 4, {**_PP2, **_NO_MONITOR}, sharded_by="world", expect_error=True),
    _loops("2x2x2-world-sampler", 8, {**_3D, **_NO_MONITOR}, sharded_by="world", expect_error=True),
]
MANUAL_REFERENCE = _manual("ddp-dp2", 2, "ddp")
MANUAL = [
    _manual("dp2-zero1", 2, {"zero_stage": 1, **_NO_MONITOR}),
    _manual("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _manual("tp2-dp2", 4, {"tensor_parallel_size": 2, **_NO_MONITOR}),
]
MANUAL_REFUSED = [_manual("2x2x2", 8, {**_3D, **_NO_MONITOR}, expect_error=True)]
# Lightning's own grad_norm in on_before_optimizer_step: named in the module's hook, refused at set-up (under a
# pipeline it would log one stage's names and a per-stage total); reached through a helper the check does not read,
# ZeRO-3's DTensor gradients make it fail at the first step, raised as the same error
GRAD_NORM_REFUSED = [
    {**_case("pp2-dp2-lightning-grad-norm", 4, {**_PP2, **_NO_MONITOR}), "module": "lightning_norms"},
    {**_case("dp2-zero3-hidden-lightning-grad-norm", 2, {"zero_stage": 3, **_NO_MONITOR}), "module": "hidden"},
]
for _refused in GRAD_NORM_REFUSED:
    _refused["expect_error"] = True
REFUSED = LOOPS_REFUSED + MANUAL_REFUSED + GRAD_NORM_REFUSED
DATA_REFERENCE = _data("ddp-dp2", 2, "ddp")
DATA = [
    _data("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _data("pp2-dp2-1f1b", 4, {**_PP2, **_NO_MONITOR}),
    _data("2x2x2", 8, {**_3D, **_NO_MONITOR}),
]
share(2, [DATA_REFERENCE])
for _world in (2, 4, 8):
    share(_world, [c for c in DATA if c["world"] == _world])
share(2, [LOOPS_REFERENCE, MANUAL_REFERENCE])
for _world in (2, 4, 8):
    share(_world, [c for c in LOOPS + MANUAL + REFUSED if c["world"] == _world])


# LoopGPT's step logs with a reduce_fx of sum, max or min: under a pipeline, Lightning gets these once per micro-batch
# (docs/step-semantics.md#logging), "ddp" with micro-batches as batches is their truth, and test_features_equal_ddp
# compares them with it; here, against "ddp" with whole batches, a pipelined layout's are left out
LOOP_PER_MICROBATCH = ("train_loss_sum", "val_loss_max", "val_loss_min")


def _without_per_microbatch(values: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    pipelined = isinstance(case["strategy"], dict) and case["strategy"].get("pipeline_parallel_size", 1) > 1
    if not pipelined:
        return values
    return {k: v for k, v in values.items() if not k.startswith(LOOP_PER_MICROBATCH)}


def _assert_rows_equal(got: dict[str, Any], want: dict[str, Any], where: str, case: Optional[dict] = None) -> None:
    assert [step for step, _ in got["rows"]] == [step for step, _ in want["rows"]], f"{where}: logged steps"
    for (step, row), (_, expected) in zip(got["rows"], want["rows"]):
        if case is not None:
            row, expected = _without_per_microbatch(row, case), _without_per_microbatch(expected, case)
        _assert_values_equal(row, expected, f"{where}, logged at step {step}")


def _assert_csv_equal(got: str, want: str, where: str, case: Optional[dict] = None) -> None:
    """The same columns, the same rows (one per logged step and epoch) and cells equal: names and counts exactly,
    values within the tolerance (the loss sums over micro-batches in another order)."""
    import csv

    got_rows, want_rows = list(csv.reader(got.splitlines())), list(csv.reader(want.splitlines()))
    assert got_rows[0] == want_rows[0], f"{where}: columns {got_rows[0]} vs {want_rows[0]}"
    assert len(got_rows) == len(want_rows), f"{where}: {len(got_rows)} rows vs ddp's {len(want_rows)}"
    for line, (got_row, want_row) in enumerate(zip(got_rows[1:], want_rows[1:]), start=2):
        assert [c == "" for c in got_row] == [c == "" for c in want_row], f"{where}, line {line}: cells filled"
        cells = {k: float(v) for k, v in zip(want_rows[0], got_row) if v}
        expected = {k: float(v) for k, v in zip(want_rows[0], want_row) if v}
        if case is not None:
            cells, expected = _without_per_microbatch(cells, case), _without_per_microbatch(expected, case)
        _assert_values_equal(cells, expected, f"{where} {line}")


def _assert_weights_equal(result: list[dict[str, Any]], reference: list[dict[str, Any]], where: str) -> None:
    params = {name: p for got in result for name, p in got["params"].items()}
    expected = reference[0]["params"]
    assert params.keys() == expected.keys()
    for name, want in expected.items():
        error = relative_error(params[name], want)
        assert error <= TOLERANCE, f"{where}: parameter {name} relative error {error:.1e}"


@pytest.mark.parametrize("case", LOOPS, ids=[c["name"] for c in LOOPS])
def test_loops_callbacks_and_hooks_equal_ddp(shared_groups, case: dict[str, Any]) -> None:
    """Every rank logs what the ``"ddp"`` rank of its data-parallel index logs (both validation loaders, step and
    epoch values, every ``reduce_fx``, the learning rates LearningRateMonitor logs as ReduceLROnPlateau lowers them,
    ``all_gather``/``reduce``/``sync_dist`` in an epoch-end hook), returns (``validate`` on two loaders) and writes
    (``BasePredictionWriter``); ModelCheckpoint keeps and names the same checkpoints with the same scores,
    EarlyStopping holds the same state, ModelSummary counts the whole model, rank 0's CSV file is ``"ddp"``'s byte
    for byte; and the weights (frozen embeddings, value clipping, the EMA callback's writes) agree."""
    if not launched(LOOPS_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(LOOPS_REFERENCE["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    assert len(result) == case["world"]
    for rank, got in enumerate(result):
        want = reference[got["data_rank"]]
        where = f"{case['name']} rank {rank}"
        _assert_rows_equal(got, want, where, case)
        fit = _without_per_microbatch(got["fit_metrics"], case)
        _assert_values_equal(fit, _without_per_microbatch(want["fit_metrics"], case), f"{where}, callback metrics")
        assert len(got["validated"]) == len(want["validated"]) == 2, f"{where}: validate on two loaders"
        for got_loader, want_loader in zip(got["validated"], want["validated"]):
            loader, want_values = _without_per_microbatch(got_loader, case), _without_per_microbatch(want_loader, case)
            _assert_values_equal(loader, want_values, f"{where}, trainer.validate")
        assert got["returned"] is None and want["returned"] is None, f"{where}: return_predictions=False"
        assert torch.equal(got["written"], want["written"]), f"{where}: written predictions differ from ddp's"
        for name in ("best", "last", "saved", "periodic"):
            assert got["checkpoint"][name] == want["checkpoint"][name], f"{where}: ModelCheckpoint {name}"
        assert got["timer"] == want["timer"] and got["timer"]["counted"], f"{where}: max_time's Timer, steps"
        _assert_values_equal(got["checkpoint"]["best_k"], want["checkpoint"]["best_k"], f"{where}: top-k scores")
        assert got["stopping"]["wait"] == want["stopping"]["wait"], f"{where}: EarlyStopping wait count"
        assert got["stopping"]["stopped_epoch"] == want["stopping"]["stopped_epoch"], f"{where}: EarlyStopping"
        _assert_values_equal({"best": got["stopping"]["best"]}, {"best": want["stopping"]["best"]}, where)
    _assert_csv_equal(result[0]["csv"], reference[0]["csv"], f"{case['name']}: rank 0's metrics.csv", case)
    _assert_weights_equal(result, reference, case["name"])


@pytest.mark.parametrize("case", LOOPS, ids=[c["name"] for c in LOOPS])
def test_model_summary_counts_the_whole_model(shared_groups, case: dict[str, Any]) -> None:
    """Lightning's ModelSummary on every rank counts what ``"ddp"``'s does: the whole model's parameters, trainable
    ones (frozen embeddings left out) and each layer's, not one stage's or one shard's."""
    if not launched(LOOPS_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    want = shared_groups(2).get(LOOPS_REFERENCE["name"])["per_rank"][0]["summary"]
    for rank, got in enumerate(shared_groups(case["world"]).get(case["name"])["per_rank"]):
        assert got["summary"] == want, f"{case['name']} rank {rank}: ModelSummary {got['summary']} vs {want}"


def test_loops_reference_exercises_what_the_matrix_claims(shared_groups) -> None:
    """The ``"ddp"`` run of the loops module really lowers the rate, logs both loaders and the epoch-end values,
    keeps two checkpoints and a last one (and periodic ones), accumulates in the second epoch and ends it early,
    counts time for ``max_time``, and its CSV has one row per logged step."""
    if not launched(LOOPS_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(LOOPS_REFERENCE["name"])["per_rank"]
    rows = reference[0]["rows"]
    names = set().union(*(row.keys() for _, row in rows))
    wanted = {"val_loss_step/dataloader_idx_0", "val_loss_epoch/dataloader_idx_1", "val_loss_max/dataloader_idx_1",
              "val_loss_min/dataloader_idx_0", "train_loss_sum", "gathered_rows", "reduced_sum", "seen_sum_sync",
              "lr-SGD"}  # fmt: skip
    assert wanted <= names, sorted(wanted - names)
    rates = [row["lr-SGD"] for _, row in rows if "lr-SGD" in row]
    assert min(rates) < max(rates), "ReduceLROnPlateau never lowered the rate"
    assert reference[0]["checkpoint"]["last"] == "last.ckpt" and len(reference[0]["checkpoint"]["best_k"]) == 2
    train_steps = sorted({step for step, row in rows if "train_loss_step" in row})
    # the first epoch's 4 optimizer steps; the second accumulates 2 batches a step (GradientAccumulationScheduler)
    # and ends before its fourth batch: one step, the third batch left over
    assert len(train_steps) == 4 + 1, train_steps
    assert {row["gathered_rows"] for _, row in rows if "gathered_rows" in row} == {2.0}
    assert reference[0]["summary"]["trainable"] < reference[0]["summary"]["total"]  # frozen embeddings
    csv_steps = [line.split(",") for line in reference[0]["csv"].splitlines()[1:]]
    assert len(csv_steps) > len(train_steps)
    assert "train_accuracy_no_grad_epoch" in names
    assert len(reference[0]["checkpoint"]["periodic"]) >= 2, reference[0]["checkpoint"]["periodic"]
    assert reference[0]["timer"]["counted"]


@pytest.mark.parametrize("case", REFUSED, ids=[c["name"] for c in REFUSED])
def test_refused_on_every_rank_before_training(shared_groups, case: dict[str, Any]) -> None:
    """What cannot equal ``"ddp"`` is refused with the same ``HybridConfigError`` on every rank before any
    optimizer step: a user's sampler that gives tensor- or pipeline-parallel peers different batches, manual
    optimization under pipeline parallel, and Lightning's own ``grad_norm`` (the error names the replacement)."""
    errors = shared_groups(case["world"]).expected_errors(case["name"])
    assert len(errors) == case["world"], errors
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("HybridConfigError"), errors[0]
    if case in GRAD_NORM_REFUSED:
        assert "from lightning_hybrid import grad_norm" in errors[0], errors[0]


@pytest.mark.parametrize("case", MANUAL, ids=[c["name"] for c in MANUAL])
def test_manual_optimization_two_optimizers_equal_ddp(shared_groups, case: dict[str, Any]) -> None:
    """Manual optimization with two optimizers (``manual_backward`` twice a step, ``self.clip_gradients`` by norm and
    by value): the logged losses of every step and the weights equal ``"ddp"``'s."""
    if not launched(MANUAL_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(MANUAL_REFERENCE["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    for rank, got in enumerate(result):
        _assert_rows_equal(got, reference[got["data_rank"]], f"{case['name']} rank {rank}")
    _assert_weights_equal(result, reference, case["name"])


@pytest.mark.parametrize("case", DATA, ids=[c["name"] for c in DATA])
def test_data_features_equal_ddp(shared_groups, case: dict[str, Any]) -> None:
    """Two training loaders in a ``CombinedLoader`` (one map-style with Lightning's sampler, one ``IterableDataset``
    the user shards by ``distributed_sampler_kwargs``), ``check_val_every_n_epoch=2``, then a fit with
    ``overfit_batches=2``: every rank logs what the ``"ddp"`` rank of its data-parallel index logs, and the weights
    after each fit agree."""
    if not launched(DATA_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(DATA_REFERENCE["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    assert len(result) == case["world"]
    for rank, got in enumerate(result):
        want = reference[got["data_rank"]]
        for fit in ("combined", "overfit"):
            where = f"{case['name']} rank {rank}, {fit} fit"
            _assert_rows_equal({"rows": got[f"{fit}_rows"]}, {"rows": want[f"{fit}_rows"]}, where)
            _assert_values_equal(got[f"{fit}_metrics"], want[f"{fit}_metrics"], f"{where}, callback metrics")
    combined = [{"params": got["combined_params"]} for got in result]
    _assert_weights_equal(combined, [{"params": reference[0]["combined_params"]}], f"{case['name']}, combined fit")
    _assert_weights_equal(result, reference, f"{case['name']}, overfit fit")


def test_data_reference_exercises_what_the_matrix_claims(shared_groups) -> None:
    """The ``"ddp"`` run of the data module validates only in its second epoch, trains on both loaders, and
    ``overfit_batches=2`` gives 2 optimizer steps an epoch."""
    if not launched(DATA_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(DATA_REFERENCE["name"])["per_rank"][0]
    combined = reference["combined_rows"]
    validated_at = sorted({step for step, row in combined if "val_loss_epoch" in row})
    assert len(validated_at) == 1 and validated_at[0] >= 3, validated_at  # after the second epoch's steps only
    assert len({step for step, row in combined if "train_loss_step" in row}) == 2 * 3
    assert len({step for step, row in reference["overfit_rows"] if "train_loss_step" in row}) == 2 * 2


# ---------------------------------------------------------------------------------------------------------------
# The tuner, SWA, several loggers at once, evaluation inside a fit (tests/features_extra.py: run_extras)


def _extras(name: str, world: int, strategy: Any, **extra: Any) -> dict[str, Any]:
    return {**_case(f"extras-{name}", world, strategy), "runner": "feature_extras", **extra}


EXTRAS_REFERENCE = _extras("ddp-dp2", 2, "ddp")
EXTRAS = [
    _extras("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _extras("tp2-dp2", 4, {"tensor_parallel_size": 2, **_NO_MONITOR}),
    _extras("pp2-dp2-1f1b", 4, {**_PP2, **_NO_MONITOR}),
    _extras("2x2x2", 8, {**_3D, **_NO_MONITOR}),
]
share(2, [EXTRAS_REFERENCE])
for _world in (2, 4, 8):
    share(_world, [c for c in EXTRAS if c["world"] == _world])


def _error(outcome: dict[str, Any]) -> str:
    assert "error" in outcome, f"expected an error, got {outcome}"
    return outcome["error"]


@pytest.mark.parametrize("case", EXTRAS, ids=[c["name"] for c in EXTRAS])
def test_tuner_loggers_and_evaluation_inside_a_fit_equal_ddp(shared_groups, case: dict[str, Any]) -> None:
    """``Tuner.lr_find`` gives ``"ddp"``'s loss curve and suggestion and restores the weights exactly (its temporary
    checkpoint removed); ``Tuner.scale_batch_size`` is refused as under ``"ddp"`` (Lightning refuses it under any
    distributed strategy); the fit after the tuner logs ``"ddp"``'s rows; ``trainer.validate`` and ``trainer.test``
    called from a fit hook (another fit) return ``"ddp"``'s values, then that fit fails at the epoch's end with
    Lightning's own error, as under ``"ddp"``; rank 0's CSV, TensorBoard and W&B files hold ``"ddp"``'s rows and
    values."""
    if not launched(EXTRAS_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(EXTRAS_REFERENCE["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    assert len(result) == case["world"]
    for rank, record in enumerate(result):
        got, want = record["tuner_and_fit"], reference[_data_rank(record)]["tuner_and_fit"]
        where = f"{case['name']} rank {rank}"
        found, expected = got["lr_find"]["value"], want["lr_find"]["value"]
        assert len(found["losses"]) == len(expected["losses"]) == 4, where
        _assert_values_equal(dict(enumerate(found["losses"])), dict(enumerate(expected["losses"])), f"{where} lr_find")
        assert found["suggestion"] == expected["suggestion"] == got["rate"], f"{where}: suggested rate"
        assert found["left"] == [], f"{where}: lr_find left its checkpoint {found['left']}"
        # this rank's own weights (its stages' under a pipeline), restored bit for bit
        assert got["after_lr_find"].keys() == got["after_scale"].keys() <= got["initial"].keys(), where
        for name, restored in got["after_lr_find"].items():
            assert torch.equal(restored, got["initial"][name]), f"{where}: {name} not restored by lr_find"
            assert torch.equal(got["after_scale"][name], restored), f"{where}: {name} changed by scale_batch_size"
        assert _error(got["scale"]) == _error(want["scale"]), where
        assert got["batch_size"] == want["batch_size"] == 2, where
        assert "error" not in got["fit"] and "error" not in want["fit"], f"{where}: the fit {got['fit']}"
        inside, inside_ddp = record["inside"], reference[_data_rank(record)]["inside"]
        assert _error(inside) == _error(inside_ddp), f"{where}: the fit that evaluates inside"
        assert inside["steps"] == inside_ddp["steps"] == 1, where
        for kind in ("validate", "test"):
            assert len(inside["inside"][kind]["value"]) == 1, f"{where}: {kind} inside the fit"
            _assert_values_equal(
                inside["inside"][kind]["value"][0], inside_ddp["inside"][kind]["value"][0], f"{where} {kind}"
            )
        _assert_rows_equal(got, want, where)
    fits = [{"params": r["tuner_and_fit"]["params"]} for r in result]
    _assert_weights_equal(fits, [{"params": reference[0]["tuner_and_fit"]["params"]}], f"{case['name']}, the fit")
    got, want = result[0]["tuner_and_fit"], reference[0]["tuner_and_fit"]
    _assert_csv_equal(got["csv"], want["csv"], f"{case['name']}: rank 0's metrics.csv")
    assert [(t, s) for t, s, _ in got["tensorboard"]] == [(t, s) for t, s, _ in want["tensorboard"]], "TensorBoard"
    for (tag, step, value), (_, _, expected) in zip(got["tensorboard"], want["tensorboard"]):
        _assert_values_equal({tag: value}, {tag: expected}, f"{case['name']}: TensorBoard at step {step}")
    from tests.log_readers import read_wandb_run

    assert len(got["wandb_dirs"]) == len(want["wandb_dirs"]) == 1, got["wandb_dirs"]  # one run, from rank 0
    history = read_wandb_run(Path(got["wandb_dirs"][0]))["history"]
    expected_history = read_wandb_run(Path(want["wandb_dirs"][0]))["history"]
    assert len(history) == len(expected_history) > 0, f"{case['name']}: W&B rows"
    for row, expected_row in zip(history, expected_history):
        numbers = {k: float(v) for k, v in row.items() if not k.startswith("_")}
        _assert_values_equal(numbers, {k: float(v) for k, v in expected_row.items() if not k.startswith("_")}, "W&B")


def _data_rank(record: dict[str, Any]) -> int:
    return record["tuner_and_fit"]["data_rank"]


@pytest.mark.parametrize("case", EXTRAS, ids=[c["name"] for c in EXTRAS])
def test_weight_averaging_refused_on_a_split_model(shared_groups, case: dict[str, Any]) -> None:
    """``StochasticWeightAveraging`` (which trains under ``"ddp"``) is refused with the same ``HybridConfigError``
    on every rank before any step, naming what splits the parameters."""
    if not launched(EXTRAS_REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(EXTRAS_REFERENCE["name"])["per_rank"]
    assert all("error" not in r["swa"] and r["swa"]["steps"] == 4 for r in reference), reference[0]["swa"]
    outcomes = [r["swa"] for r in shared_groups(case["world"]).get(case["name"])["per_rank"]]
    errors = {_error(o) for o in outcomes}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("HybridConfigError: StochasticWeightAveraging cannot average a split model"), error
    assert all(o["steps"] == 0 for o in outcomes)
