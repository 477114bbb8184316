"""Issue: sharded checkpoint IO. Resharding into other layouts, atomic saves (a killed save), checked loads, async.

Resharding: one 8-process group trains the nanoGPT example at (tp=2, pp=2, dp=2, ZeRO-1), saving mid-epoch at step 3,
and goes on to step 6 (the original layout's continuation). Scenarios in the same group then load that checkpoint
under other layouts and train steps 4-6 with the same global batch; a 1-process group loads it at (1, 1, 1).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import launch, relative_error

TOL = 1e-5
SAVE_AT, STEPS = 3, 6
GLOBAL_BATCH = 32  # 8 steps per epoch over the 256 samples: step 3 is mid-epoch
# bias=False: the attention key bias has an exactly zero gradient, where Adam turns summation-order noise into full
# steps (see tests/test_foundation.py); n_layer=4 allows four pipeline stages
MODEL = {"n_layer": 4, "bias": False}
# a different learning rate in every resumed module: the checkpoint's optimizer hyper-parameters must win
RESUMED_MODEL = {**MODEL, "learning_rate": 0.5}
SOURCE_CKPT = f"reshard-source/*step={SAVE_AT}.ckpt"


def _case(name: str, tp: int, pp: int, dp: int, zero: int, **extra: Any) -> dict[str, Any]:
    strategy = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "zero_stage": zero}
    if pp > 1:
        strategy["num_microbatches"] = pp
    return {"name": name, "model": "nanogpt", "model_kwargs": RESUMED_MODEL, "strategy": strategy,
            "steps": STEPS, "batch_size": GLOBAL_BATCH // dp, "data_parallel_size": dp, "resume_from": SOURCE_CKPT,
            **extra}  # fmt: skip


SOURCE = {
    **_case("reshard-source", 2, 2, 2, 1),
    "model_kwargs": MODEL,
    "resume_from": None,
    "callbacks": [{"kind": "ModelCheckpoint", "every_n_train_steps": SAVE_AT, "save_top_k": -1}],
}
TARGETS8 = [
    _case("reshard-to-tp1-pp4-dp2", 1, 4, 2, 1),
    _case("reshard-to-tp4-pp1-dp2", 4, 1, 2, 1),
    _case("reshard-to-tp2-pp2-dp2-zero3", 2, 2, 2, 3),
    _case("reshard-to-tp1-pp2-dp4", 1, 2, 4, 1),
]
TARGETS = [*TARGETS8, "reshard-to-tp1-pp1-dp1"]


@pytest.fixture(scope="module")
def reshard_groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reshard8")
    group8 = launch(8, [SOURCE, *TARGETS8], out, timeout=600)
    checkpoint = next(out.glob(SOURCE_CKPT), None)
    single = _case("reshard-to-tp1-pp1-dp1", 1, 1, 1, 1, resume_from=str(checkpoint))
    group1 = launch(1, [single], tmp_path_factory.mktemp("reshard1"), timeout=300)
    return {"source": group8, **{t["name"]: group8 for t in TARGETS8}, single["name"]: group1}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", [t if isinstance(t, str) else t["name"] for t in TARGETS])
def test_checkpoint_loads_into_another_layout(reshard_groups: dict[str, Any], target: str) -> None:
    """Saved at (tp=2, pp=2, dp=2, ZeRO-1) mid-epoch; loaded at ``target``: the first loss after loading equals the
    original layout's loss at that step, and after 3 more steps every parameter agrees (same global batch)."""
    original = reshard_groups["source"].get("reshard-source")
    resumed = reshard_groups[target].get(target)
    assert len(original["losses"]) == STEPS
    assert len(resumed["losses"]) == STEPS - SAVE_AT, "the resumed run must start at the saved step"
    for step, (got, want) in enumerate(zip(resumed["losses"], original["losses"][SAVE_AT:]), start=SAVE_AT + 1):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} after loading, {want} in the original"
    assert resumed["params"].keys() == original["params"].keys()
    for name, want in original["params"].items():
        err = relative_error(resumed["params"][name], want)
        assert err <= TOL, f"{name} after step {STEPS}: relative error {err:.2e} against the original layout"
