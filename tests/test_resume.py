"""Where training goes on after each kind of checkpoint a user can make (docs/checkpoint.md, "Where a resumed run
goes on"): a ``ModelCheckpoint`` mid-epoch, the ``last.ckpt`` of a run killed mid-epoch, a ``ModelCheckpoint`` at an
epoch's end, ``trainer.save_checkpoint`` after a ``fit(max_steps=...)`` that stopped mid-epoch returned, and a loader
that restores its own position. Saved at dp=2 (ZeRO-1) and resumed at pp=2 in a 2-process shared launch
(tests/resume_runs.py), each resumed step fingerprinted by the samples of its global batch, against the batches of
the uninterrupted run (inside an epoch) or ``"ddp"`` resumed from its own checkpoint of the same kind (where the
checkpoint's epoch had run all its batches, Lightning's loop decides: the package leaves it as under ``"ddp"``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import launched, share
from tests.harness import reference_loader
from tests.resume_runs import GLOBAL_BATCH, KILLED_AT, NOT_RESUMABLE, SAVE_EVERY, TOTAL_STEPS, dataset, sample_key


def _case(name: str, save: Any, resume: Any, save_dp: int, resume_dp: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "runner": "resume", "save": save, "resume": resume, "save_dp": save_dp,
            "resume_dp": resume_dp, "timeout_s": 600, **extra}  # fmt: skip


DDP = _case("resume-kinds-ddp", "ddp", "ddp", 2, 2)
HYBRID = _case("resume-kinds-dp2-to-pp2", {"zero_stage": 1}, {"pipeline_parallel_size": 2}, 2, 1)
RESUMABLE = _case("resume-resumable-dp2-to-pp2", {"zero_stage": 1}, {"pipeline_parallel_size": 2}, 2, 1,
                  resumable=True)  # fmt: skip
share(2, [DDP, HYBRID, RESUMABLE])

INSIDE_EPOCH = {"mid_epoch": SAVE_EVERY, "killed_last": KILLED_AT}  # kind -> the step it was saved after
EPOCH_RAN = ("epoch_end", "saved_after_fit")


@pytest.fixture(scope="module")
def group2(shared_groups):
    return shared_groups(2)


def _uninterrupted() -> list[tuple[int, int, list[int]]]:
    """Every step of the run never stopped: (epoch, batch index, the global batch's sorted sample keys), from the
    samplers Lightning gives the replicas (harness.reference_loader)."""
    data = dataset()
    per_epoch = len(data) // GLOBAL_BATCH
    loader = reference_loader(data, 2, GLOBAL_BATCH // 2, epochs=TOTAL_STEPS // per_epoch)
    return [(j // per_epoch, j % per_epoch, sorted(sample_key(x) for x in batch[0])) for j, batch in
            enumerate(loader)]  # fmt: skip


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", INSIDE_EPOCH)
def test_resume_inside_an_epoch_trains_the_batches_of_the_uninterrupted_run(group2, kind: str) -> None:
    """Resumed into an interrupted epoch (in another layout), the next steps train exactly what the run never stopped
    trains next; Lightning's own warning that the loader cannot resume is not printed (the position is restored)."""
    resumed = group2.get(HYBRID["name"])[kind]
    whole = _uninterrupted()
    assert resumed["steps"] == whole[INSIDE_EPOCH[kind]:]
    assert not [w for w in resumed["warnings"] if NOT_RESUMABLE in w], resumed["warnings"]
    if launched(DDP["name"]):  # "ddp" itself starts the epoch's loader again and says so: what the test guards
        ddp = group2.get(DDP["name"])[kind]
        assert ddp["steps"] != resumed["steps"]
        assert [w for w in ddp["warnings"] if NOT_RESUMABLE in w], ddp["warnings"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", EPOCH_RAN)
def test_resume_after_an_epoch_ran_all_its_batches_trains_what_ddp_trains(group2, kind: str) -> None:
    """An epoch-end checkpoint, and ``trainer.save_checkpoint`` after a fit stopped by ``max_steps`` (Lightning then
    counts the epoch as finished): nothing is skipped; each step trains the batch ``"ddp"`` resumed from its own
    checkpoint of the kind trains (before, the second skipped the next epoch's first batches)."""
    if not launched(DDP["name"]):
        pytest.skip("the ddp reference is not launched in this pytest run (--scenarios)")
    resumed, ddp = group2.get(HYBRID["name"])[kind], group2.get(DDP["name"])[kind]
    assert len(resumed["steps"]) == TOTAL_STEPS - (4 if kind == "epoch_end" else 3)
    assert resumed["steps"] == ddp["steps"]
    # Lightning warns alike where it does not restore the position (global step not at an epoch's end)
    warned = [any(NOT_RESUMABLE in w for w in r["warnings"]) for r in (resumed, ddp)]
    assert warned[0] == warned[1], (resumed["warnings"], ddp["warnings"])


@pytest.mark.timeout(1200)
def test_a_loader_that_restores_its_own_position_is_not_skipped_again(group2) -> None:
    """A loader with ``state_dict``/``load_state_dict``: Lightning saves and restores its position; the resumed run
    trains the uninterrupted run's next batches, not those after skipping twice."""
    resumed = group2.get(RESUMABLE["name"])["resumable"]
    assert resumed["steps"] == _uninterrupted()[SAVE_EVERY:]


# ------------------------------------------------------------------------------------------------ single process
def _trainer(epoch: tuple[int, int], processed: int, last: bool, states: list[Any] = ()) -> Any:
    """What ``finished_batches_of_epoch`` reads: the fit loop as restored from a checkpoint (started, processed)."""
    started, done = epoch
    batches = SimpleNamespace(current=SimpleNamespace(processed=processed), is_last_batch=last)
    loop = SimpleNamespace(restarting=True, epoch_progress=SimpleNamespace(current=SimpleNamespace(
        started=started, processed=done)), epoch_loop=SimpleNamespace(batch_progress=batches),
        _combined_loader_states_to_load=list(states))  # fmt: skip
    return SimpleNamespace(training=True, fit_loop=loop)


class _Stateful(list):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize(
    ("epoch", "processed", "last", "loader", "states", "skipped"),
    [
        ((1, 0), 3, False, list, [], 3),  # inside an epoch: its 3 finished batches
        ((1, 0), 4, True, list, [], 0),  # at its last batch: Lightning closes the epoch at restart
        ((1, 1), 4, True, list, [], 0),  # at its end (epoch-end checkpoint)
        ((1, 1), 3, False, list, [], 0),  # max_steps stopped it: Lightning counts it finished
        ((1, 0), 3, False, _Stateful, [{}], 0),  # a loader Lightning restores: not skipped twice
        ((1, 0), 3, False, _Stateful, [], 3),  # ... unless the checkpoint holds no state for it
    ],
)
def test_batches_skipped_on_resume(epoch, processed, last, loader, states, skipped) -> None:
    from lightning_hybrid.data import SkipOnResume, release_quieted, skip_finished_batches

    data = loader(range(6))
    got = skip_finished_batches(data, _trainer(epoch, processed, last, states))
    try:
        assert list(got) == list(range(skipped, 6))
        assert isinstance(got, SkipOnResume) == bool(skipped)
    finally:
        release_quieted()


def test_the_not_resumable_warning_is_silenced_only_while_the_position_is_restored() -> None:
    import warnings

    from lightning_hybrid.data import release_quieted, skip_finished_batches

    message = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        skip_finished_batches(list(range(6)), _trainer((1, 0), 2, False))
        warnings.warn(message, UserWarning, stacklevel=1)
        release_quieted()
        warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [message]
