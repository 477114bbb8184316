"""Issue: DeepSpeed where it is the best tool. Optimizer offload with DeepSpeedCPUAdam matches the same layout without
offload, and DeepSpeed ZeRO-1/2/3 checkpoints (a raw engine's, and Lightning's DeepSpeedStrategy layout) load into
tp2 x pp2 x dp2 and continue exactly as the DeepSpeed engine does.

The multi-process scenarios join the session's shared launches (2, 4 and 8 processes); the no-offload baselines are
the same scenario dicts the foundation, pipeline and precision modules register, so the full suite runs them once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_hybrid import HybridConfigError
from tests.conftest import assert_clean_exit, console_script, relative_error, share
from tests.test_foundation import STEPS

TOL = 1e-5
MIXED_TOL = 0.02
NANOGPT = {"bias": False}
PIPELINE_2X2 = {
    "pipeline_parallel_size": 2,
    "pipeline_schedule": "1f1b",
    "num_microbatches": 2,
    "tensor_parallel_size": 2,
}


def _scenario(name: str, strategy: dict[str, Any], dp: int, steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    # the dict shape of tests/test_foundation.py's scenario(): identical baselines are launched once per session
    kwargs = {**NANOGPT, **extra.pop("model_kwargs", {})}
    return {"name": name, "model": extra.pop("model", "nanogpt"), "model_kwargs": kwargs, "strategy": strategy,
            "steps": steps, "batch_size": extra.pop("batch_size", 4), "data_parallel_size": dp, **extra}  # fmt: skip


def _offloaded(base: dict[str, Any]) -> dict[str, Any]:
    return {**base, "name": f"offload-{base['name']}", "strategy": {**base["strategy"], "offload_optimizer": True}}


# bf16-mixed at ZeRO-2 also covers the bucketed ZeRO-2 reduction under offload
BF16 = _scenario("nanogpt-dp2-zero2-bf16mixed-3", {"zero_stage": 2}, 2, steps=3, trainer={"precision": "bf16-mixed"})
# the precision module's fp16 overflow scenario: a step skipped on every rank (scaler), a per-step LR schedule
OVERFLOW = _scenario(
    "overflow-2x2x2-zero1-16mixed",
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1, "track_gradient_norm": True},
    2,
    5,
    model="nanogpt_scheduled",
    precision_plugin={"precision": "16-mixed", "hysteresis": 1, "initial_scale": 2.0**10},
    inject_inf={"step": 2, "rank": 5},
    probe=True,
)
BASELINES = {
    2: [_scenario(f"nanogpt-dp2-zero{z}", {"zero_stage": z}, 2) for z in (1, 3)] + [BF16],
    4: [_scenario("nanogpt-tp2-dp2-zero1", {"tensor_parallel_size": 2, "zero_stage": 1}, 2)],
    8: [_scenario("tp2-pp2-dp2-zero2", {**PIPELINE_2X2, "zero_stage": 2}, 2, model_kwargs={"n_layer": 4}), OVERFLOW],
}
OFFLOAD = {world: [_offloaded(b) for b in bases] for world, bases in BASELINES.items()}
PAIRS = [(world, b, o) for world in BASELINES for b, o in zip(BASELINES[world], OFFLOAD[world])]

# DeepSpeed checkpoint import: a raw engine (8 ranks, ZeRO-1/2/3) trains 3 steps and saves; tp2 x pp2 x dp2 loads it
IMPORT_STEPS = 3
SOURCES = [
    {
        "name": f"ds-source-zero{z}",
        "model": "nanogpt",
        "model_kwargs": NANOGPT,
        "batch_size": 4,
        # ZeRO-2 is written in Lightning's DeepSpeedStrategy layout (tag `checkpoint`, a `*.ckpt` folder)
        "deepspeed_source": {
            "stage": z,
            "steps": IMPORT_STEPS,
            "target_dp": 2,
            "lightning_layout": z == 2,
            "folder": "epoch=0-step=3.ckpt" if z == 2 else "ckpt",
        },
    }  # fmt: skip
    for z in (1, 2, 3)
]
IMPORTS = [
    {
        **_scenario(f"ds-import-zero{z}-to-2x2x2", {**PIPELINE_2X2, "zero_stage": z}, 2, steps=IMPORT_STEPS),
        "resume_from": f"ds-source-zero{z}/{'epoch=0-step=3.ckpt' if z == 2 else 'ckpt'}",
        "record_start_params": True,
    }
    for z in (1, 2, 3)
]

for _world in BASELINES:
    share(_world, BASELINES[_world] + OFFLOAD[_world])
share(8, SOURCES + IMPORTS)


@pytest.fixture(scope="session")
def cpu_adam_op() -> None:
    """Compile DeepSpeed's CPU Adam op once per session (into torch's extension cache) before anything uses it."""
    from lightning_hybrid.sharding.offload import cpu_adam_class

    cpu_adam_class()


def _params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    errors = {k: relative_error(a[k], b[k]) for k in b}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: {errors[worst]:.3g} > {tol}"


@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("world", "base", "offloaded"), PAIRS, ids=[o["name"] for _, _, o in PAIRS])
def test_offload_matches_the_same_layout_without_offload(shared_groups, cpu_adam_op, world, base, offloaded) -> None:
    group = shared_groups(world)
    plain, off = group.get(base["name"]), group.get(offloaded["name"])
    tol = MIXED_TOL if "precision" in base.get("trainer", {}) else TOL
    assert len(off["losses"]) == base["steps"]
    for step, (a, b) in enumerate(zip(off["losses"], plain["losses"])):
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a} vs {b} without offload"
    _params_close(off["params"], plain["params"], tol)
    # the device keeps parameters and gradients only: the optimizer state is in the offload's host memory
    for rank, plain_rank in zip(off["per_rank"], plain["per_rank"]):
        state, plain_state = rank["model_state"], plain_rank["model_state"]
        assert state["optimizer_state"] == 0, state
        assert state["offloaded_optimizer_state"] == plain_state["optimizer_state"], (state, plain_state)
        assert state["total"] == plain_state["total"] - plain_state["optimizer_state"]
    if base.get("inject_inf"):  # the overflowed step was skipped by the host optimizer too, and the LR held
        for records, plain_records in zip(off["probe"], plain["probe"]):
            seen = [(r["skipped"], r["lr"], r["scheduler_steps"]) for r in records]
            assert seen == [(r["skipped"], r["lr"], r["scheduler_steps"]) for r in plain_records], seen
            assert records[-1]["skipped"] == 1, records


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_deepspeed_checkpoint_continues_as_deepspeed_does(shared_groups, stage) -> None:
    group = shared_groups(8)
    source, imported = group.get(f"ds-source-zero{stage}"), group.get(f"ds-import-zero{stage}-to-2x2x2")
    # identical weights at the hand-over: what the DeepSpeed engine held when it saved
    for name, value in source["handover"].items():
        assert torch.equal(imported["start_params"][name], value), name
    assert len(imported["losses"]) == IMPORT_STEPS
    for step, (a, b) in enumerate(zip(imported["losses"], source["losses"])):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs DeepSpeed's {b}"
    _params_close(imported["params"], source["params"], TOL)


@pytest.mark.timeout(600)
def test_convert_command_writes_our_format(shared_groups, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    group = shared_groups(8)
    source = Path(group.get("ds-source-zero3")["path"])
    out = tmp_path / "converted.ckpt"
    proc = console_script("convert", "deepspeed", str(source), str(out), timeout=300)
    assert_clean_exit(proc)
    assert (out / "meta.pt").is_file() and (out / ".metadata").is_file()
    from lightning_hybrid.checkpoint import consolidate

    weights = load_file(consolidate(out, tmp_path / "full") / "model.safetensors")
    expected = get_fp32_state_dict_from_zero_checkpoint(str(source))
    assert set(expected) <= set(weights)
    for name, value in expected.items():
        assert torch.equal(weights[name], value.float()), name
    from lightning_hybrid.checkpoint.format import SafeFileSystemReader

    keys = set(SafeFileSystemReader(str(out)).read_metadata().state_dict_metadata)
    for name in expected:
        for stat in ("exp_avg", "exp_avg_sq", "step"):
            assert f"optimizer_0.state.{name}.{stat}" in keys, (name, stat)
        assert f"optimizer_0.master.{name}" in keys


# ---------------------------------------------------------------------------------------------- single process
def _steps(optimizer_cls: type, offload: bool, **kwargs: Any) -> list[torch.Tensor]:
    from lightning_hybrid.sharding.offload import OptimizerOffload

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(11))]
    groups = [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]
    optimizer = optimizer_cls(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-7, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    if offload:
        OptimizerOffload(optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        scheduler.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [(torch.optim.AdamW, ()), (torch.optim.Adam, ()), (torch.optim.Adam, (("decoupled_weight_decay", True),))],
    ids=["AdamW", "Adam-L2", "Adam-decoupled"],
)
def test_cpu_adam_steps_as_torch_does(cpu_adam_op, optimizer_cls, kwargs) -> None:
    """Hyper-parameters per group (weight decay), from a scheduler (lr), Adam's L2 and AdamW's decoupled decay."""
    expected = _steps(optimizer_cls, False, **dict(kwargs))
    for a, b in zip(_steps(optimizer_cls, True, **dict(kwargs)), expected):
        assert relative_error(a, b) <= 1e-6


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), r"Adam and AdamW only; `configure_optimizers` returned SGD"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), r"AdamW\(amsgrad=True\)"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), r"Adam\(maximize=True\)"),
        (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1)), r"`lr` is a tensor"),
    ],
    ids=["sgd", "amsgrad", "maximize", "tensor-lr"],
)
def test_offload_refuses_what_cpu_adam_cannot_replace(make, match) -> None:
    from lightning_hybrid.sharding.offload import check_offloadable

    with pytest.raises(HybridConfigError, match=match):
        check_offloadable(make(torch.nn.Linear(2, 2).parameters()))


def test_missing_deepspeed_names_the_extra(monkeypatch) -> None:
    from lightning_hybrid.sharding.offload import cpu_adam_class

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", None)
    with pytest.raises(HybridConfigError, match=r'pip install "lightning-hybrid\[deepspeed\]"'):
        cpu_adam_class()
