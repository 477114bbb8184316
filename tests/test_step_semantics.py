"""Issue: the user's step runs as it does under ``"ddp"``, whatever it does. Steps shaped as users write them
(tests/step_shapes.py: random masks and noise drawn before the network, two network calls coupled in one loss, a
frozen reference network, a counter and a list on ``self``, every ``reduce_fx``, a torchmetrics object, an argmax in
``predict_step``) under pipeline, tensor, data and 3D layouts, against Lightning's ``"ddp"`` with the same
data-parallel size on the same data, each micro-batch a call of the step (``accumulate_grad_batches`` times the
micro-batches). Half the layouts run with the first-step checks on (their default for these small fp32 models), half
with both off: nothing here may depend on them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import launched, relative_error, share

TOLERANCE = 1e-5
LOGGED_TOLERANCE = 1e-6
_OFF = {"verify_pipeline": False, "verify_tensor_parallel": False}
_PP2 = {"pipeline_parallel_size": 2, "num_microbatches": 2}
_INTERLEAVED = {**_PP2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2}
_TP2 = {"tensor_parallel_size": 2}
_3D = {**_PP2, **_TP2}


def _case(shape: str, layout: str, world: int, strategy: Any) -> dict[str, Any]:
    return {"name": f"steps-{shape}-{layout}", "runner": "feature_step_shapes", "shape": shape, "world": world,
            "strategy": strategy if isinstance(strategy, str) else {**strategy, "monitor": False},
            "timeout_s": 600}  # fmt: skip


REFERENCES = {shape: _case(shape, "ddp-dp2", 2, "ddp") for shape in ("draws", "pair", "views")}
# each process seeded by its rank: a replica's ranks (here its first and its second stage: global ranks d and d + 2)
# must still draw one mask, its first rank's (global rank d, as "ddp"'s rank d)
REFERENCES["draws-seeded"] = {**_case("draws", "ddp-dp2-seed-per-rank", 2, "ddp"), "seed_per_rank": True}
LAYOUTS = [
    # random draws before the network: every layout the issue names, checks on for two of them
    _case("draws", "pp2-dp2", 4, _PP2),
    _case("draws", "tp2-dp2", 4, _TP2),
    _case("draws", "dp2-zero3", 2, {"zero_stage": 3, **_OFF}),
    _case("draws", "pp2-dp2-interleaved", 4, {**_INTERLEAVED, **_OFF}),
    _case("draws", "2x2x2", 8, {**_3D, **_OFF}),
    {**_case("draws", "pp2-dp2-seed-per-rank", 4, {**_PP2, **_OFF}), "seed_per_rank": True,
     "reference": "draws-seeded"},
    # two coupled network calls, a chosen/rejected pair and a frozen reference network
    _case("pair", "pp2-dp2", 4, {**_PP2, **_OFF}),
    _case("pair", "tp2-dp2-zero3", 4, {**_TP2, "zero_stage": 3}),
    _case("pair", "2x2x2", 8, _3D),
    # two views and a consistency term between the calls' log-probabilities
    _case("views", "pp2-dp2", 4, _PP2),
    _case("views", "tp2-dp2", 4, {**_TP2, **_OFF}),
    _case("views", "2x2x2", 8, {**_3D, **_OFF}),
]
share(2, list(REFERENCES.values()))
for _world in (2, 4, 8):
    share(_world, [c for c in LAYOUTS if c["world"] == _world])


@pytest.mark.parametrize("case", LAYOUTS, ids=[c["name"] for c in LAYOUTS])
def test_step_runs_as_under_ddp(shared_groups, case: dict[str, Any]) -> None:
    """Every rank of the layout counts the calls ``"ddp"``'s rank of its data-parallel index counts (the counter and
    the lists on ``self`` appended before and after the network call), ends the epoch with its
    logged values (every ``reduce_fx``, an explicit ``batch_size``, a torchmetrics object in validation), predicts
    what it predicts (the argmax of the logits), and the trained weights agree with it (the random draws, both calls
    and the frozen network included)."""
    reference_case = REFERENCES[case.get("reference", case["shape"])]
    if not launched(reference_case["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    reference = shared_groups(2).get(reference_case["name"])["per_rank"]
    result = shared_groups(case["world"]).get(case["name"])["per_rank"]
    for rank, got in enumerate(result):
        want = reference[got["data_rank"]]
        where = f"{case['name']} rank {rank}"
        assert got["calls"] == want["calls"] == 6, f"{where}: training_step ran {got['calls']} times"
        # each micro-batch's call gets the index of the batch it is part of (the loop's): "ddp"'s calls count on
        microbatches = 1 if isinstance(case["strategy"], str) else case["strategy"].get("num_microbatches", 1)
        assert got["seen"] == [i // microbatches for i in want["seen"]], f"{where}: the list appended before the call"
        # after the network call: the earlier pipeline stages run it on stand-ins; where a value read of the output
        # ends it there ("draws" indexes the logits with its boolean mask), the last stage's list and counter are
        # mirrored to them (docs/step-semantics.md): "ddp"'s on every rank either way
        after = [i // microbatches for i in want["after"]]
        assert got["after"] == after, f"{where}: the list appended after the network call"
        assert got["calls_after"] == want["calls_after"] == 6, f"{where}: {got['calls_after']} counted after the call"
        assert got["epoch_values"].keys() == want["epoch_values"].keys(), where
        for key, value in want["epoch_values"].items():
            error = abs(got["epoch_values"][key] - value) / max(abs(value), 1e-12)
            assert error <= LOGGED_TOLERANCE, f"{where}: {key} = {got['epoch_values'][key]} vs ddp's {value}"
        assert torch.equal(got["predictions"], want["predictions"]), f"{where}: predictions differ from ddp's"
        # what the step returned beside its loss, as on_train_batch_end got it (each micro-batch's, in order)
        assert torch.equal(got["train_preds"], want["train_preds"]), f"{where}: the step's returned predictions"
    params = {name: p for got in result for name, p in got["params"].items()}
    for name, want in reference[0]["params"].items():
        error = relative_error(params[name], want)
        assert error <= TOLERANCE, f"{case['name']}: parameter {name} relative error {error:.1e}"


def test_the_references_log_what_the_matrix_compares(shared_groups) -> None:
    """The ``"ddp"`` runs log every value the matrix compares, and a ``reduce_fx="sum"`` sums every call of every
    replica: its epoch value is the mean's times the calls (six a replica, two replicas, equal batches)."""
    for shape, case in REFERENCES.items():
        if case.get("seed_per_rank"):
            continue
        if not launched(case["name"]):
            pytest.skip("the ddp references are not launched in this pytest run (--scenarios)")
        values = shared_groups(2).get(case["name"])["per_rank"][0]["epoch_values"]
        wanted = {f"train_loss_{fx}" for fx in ("sum", "mean", "max", "min")} | {"train_loss_sized", "val_acc"}
        assert wanted <= set(values), (shape, sorted(wanted - set(values)))
        assert values["train_loss_sum"] == pytest.approx(12 * values["train_loss_mean"], rel=1e-5), shape
        assert values["train_loss_max"] > values["train_loss_min"], shape
