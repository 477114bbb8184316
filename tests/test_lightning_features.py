"""Issue: Lightning features under every layout. torchmetrics objects and ``MetricCollection`` logged in training and
validation, ``self.log`` with every ``reduce_fx`` and ``sync_dist``, ``accumulate_grad_batches=2`` with a per-step LR
scheduler, validation during the fit, then ``trainer.validate``, ``trainer.test`` and ``trainer.predict``: each layout
against Lightning's own ``"ddp"`` with the same data-parallel size on the same data (Lightning gives every distributed
strategy a shuffling ``DistributedSampler``, so ``"ddp"`` is the truth, not one device). The scenarios run in the
shared launches of 2, 4 and 8 processes (tests/features.py); docs/lightning-features.md holds the matrix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import launched, relative_error, share

TOLERANCE = 1e-5
_NO_MONITOR = {"monitor": False}  # the strategy's own monitor logs more names than "ddp" does
_PLAIN_LOGITS = {"vocab_parallel_loss": False}  # the module takes the argmax of its logits (docs/tensor-parallel.md)


def _case(name: str, world: int, strategy: Any) -> dict[str, Any]:
    return {"name": f"features-{name}", "runner": "features", "strategy": strategy, "world": world, "timeout_s": 600}


REFERENCE = _case("ddp-dp2", 2, "ddp")
LAYOUTS = [
    _case("dp2-zero3", 2, {"zero_stage": 3, **_NO_MONITOR}),
    _case("tp2-dp2", 4, {"tensor_parallel_size": 2, **_PLAIN_LOGITS, **_NO_MONITOR}),
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
            **_PLAIN_LOGITS,
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
            **_PLAIN_LOGITS,
            **_NO_MONITOR,
        },
    ),
]
share(2, [REFERENCE])
for _world in (2, 4, 8):
    share(_world, [c for c in LAYOUTS if c["world"] == _world])


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
    if not launched(REFERENCE["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(REFERENCE["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    assert len(result) == case["world"]
    for rank, got in enumerate(result):
        want = reference[got["data_rank"]]
        where = f"{case['name']} rank {rank}"
        assert [step for step, _ in got["rows"]] == [step for step, _ in want["rows"]], f"{where}: logged steps"
        for (step, row), (_, expected) in zip(got["rows"], want["rows"]):
            _assert_values_equal(row, expected, f"{where}, logged at step {step}")
        _assert_values_equal(got["fit_metrics"], want["fit_metrics"], f"{where}, callback metrics after fit")
        for kind in ("validated", "tested"):
            assert len(got[kind]) == len(want[kind]) == 1, f"{where}: {kind}"
            _assert_values_equal(got[kind][0], want[kind][0], f"{where}, trainer.{kind[:-2]}e")
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
