"""Issue: sharded checkpoint IO. Resharding into other layouts, atomic saves (a killed save), checked loads, async.

Resharding: one 8-process group trains the nanoGPT example at (tp=2, pp=2, dp=2, ZeRO-1), saving mid-epoch at step 3,
and goes on to step 6 (the original layout's continuation). Scenarios in the same group then load that checkpoint
under other layouts (sizes, ZeRO stage, pipeline partition, virtual stages) and train steps 4-6 with the same global
batch; a 1-process group loads it at (1, 1, 1). A second source does the same with a network that has bare
parameters (``nn.Parameter`` on the network itself, outside every pipeline stage's modules).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from tests.checkpoint_faults import flip_byte
from tests.conftest import launch, relative_error, share
from tests.harness import run_reference

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
    strategy = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "zero_stage": zero,
                **extra.pop("pipeline", {})}  # fmt: skip
    if pp > 1:
        strategy["num_microbatches"] = pp
    return {"name": name, "model": "nanogpt", "model_kwargs": RESUMED_MODEL, "strategy": strategy,
            "steps": STEPS, "batch_size": GLOBAL_BATCH // dp, "data_parallel_size": dp, "resume_from": SOURCE_CKPT,
            **extra}  # fmt: skip


def _source(name: str, **extra: Any) -> dict[str, Any]:
    return {**_case(name, 2, 2, 2, 1), "model_kwargs": MODEL, "resume_from": None,
            "callbacks": [{"kind": "ModelCheckpoint", "every_n_train_steps": SAVE_AT, "save_top_k": -1}],
            **extra}  # fmt: skip


SOURCE = _source("reshard-source")
# the same, with bare parameters on the network (tests/pipeline_models.py: a position embedding read on the first
# stage, a gain read on the last): their weights and optimizer state must come from the stage that trains them
ROOT_SOURCE = _source("reshard-root-source", model="posemb_gpt")
ROOT_CKPT = f"reshard-root-source/*step={SAVE_AT}.ckpt"


def _root_case(name: str, tp: int, pp: int, dp: int, zero: int, **extra: Any) -> dict[str, Any]:
    return _case(name, tp, pp, dp, zero, model="posemb_gpt", resume_from=ROOT_CKPT, **extra)


TARGETS8 = [
    _case("reshard-to-tp1-pp4-dp2", 1, 4, 2, 1),
    _case("reshard-to-tp4-pp1-dp2", 4, 1, 2, 1),
    _case("reshard-to-tp2-pp2-dp2-zero3", 2, 2, 2, 3),
    _case("reshard-to-tp1-pp2-dp4", 1, 2, 4, 1),
    # another pipeline partition (blocks 1 + 3 instead of 2 + 2), and virtual stages (4 stages on 2 ranks)
    _case("reshard-to-tp2-pp2-dp2-partition-1-3", 2, 2, 2, 1, pipeline={"pipeline_partition": [1, 3]}),
    _case("reshard-to-tp1-pp2-dp4-virtual2", 1, 2, 4, 1,
          pipeline={"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_size": 2}),
    _root_case("reshard-root-to-tp2-pp2-dp2", 2, 2, 2, 1),
    _root_case("reshard-root-to-tp1-pp4-dp2-zero3", 1, 4, 2, 3),
]  # fmt: skip
TARGETS = [*TARGETS8, "reshard-to-tp1-pp1-dp1", "reshard-root-to-tp1-pp1-dp1"]
TARGET_NAMES = [t if isinstance(t, str) else t["name"] for t in TARGETS]
SOURCE_OF = {t: "reshard-root-source" if t.startswith("reshard-root-") else "reshard-source" for t in TARGET_NAMES}


share(8, [SOURCE, ROOT_SOURCE, *TARGETS8])  # launched with the other modules' 8-process scenarios


@pytest.fixture(scope="module")
def reshard_groups(shared_groups, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    group8 = shared_groups(8)
    out = group8.out_dir
    singles = [
        _case("reshard-to-tp1-pp1-dp1", 1, 1, 1, 1, resume_from=str(next(out.glob(SOURCE_CKPT), None))),
        _root_case("reshard-root-to-tp1-pp1-dp1", 1, 1, 1, 1),
    ]
    singles[1]["resume_from"] = str(next(out.glob(ROOT_CKPT), None))
    group1 = launch(1, singles, tmp_path_factory.mktemp("reshard1"), timeout=300)
    return {"source": group8, **{t["name"]: group8 for t in TARGETS8}, **{t["name"]: group1 for t in singles}}


@pytest.mark.timeout(2400)  # the first one waits for the session's shared 8-process launch
@pytest.mark.parametrize("target", TARGET_NAMES)
def test_checkpoint_loads_into_another_layout(reshard_groups: dict[str, Any], target: str) -> None:
    """Saved at (tp=2, pp=2, dp=2, ZeRO-1) mid-epoch; loaded at ``target``: the first loss after loading equals the
    original layout's loss at that step, and after 3 more steps every parameter agrees (same global batch). The
    ``-root-`` targets load a source whose network has bare parameters (position embedding, gain)."""
    original = reshard_groups["source"].get(SOURCE_OF[target])
    resumed = reshard_groups[target].get(target)
    assert len(original["losses"]) == STEPS
    assert len(resumed["losses"]) == STEPS - SAVE_AT, "the resumed run must start at the saved step"
    for step, (got, want) in enumerate(zip(resumed["losses"], original["losses"][SAVE_AT:]), start=SAVE_AT + 1):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got} after loading, {want} in the original"
    assert resumed["params"].keys() == original["params"].keys()
    for name, want in original["params"].items():
        err = relative_error(resumed["params"][name], want)
        assert err <= TOL, f"{name} after step {STEPS}: relative error {err:.2e} against the original layout"


# ---------------------------------------------------------------- atomic saves, checked loads, async saves (2 ranks)
SMALL = {"n_layer": 2, "bias": False}
SMALL_STEPS = 6


def _dp2(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": "nanogpt", "model_kwargs": SMALL, "strategy": {"zero_stage": 1}, "batch_size": 16,
            "steps": SMALL_STEPS, "data_parallel_size": 2, **extra}  # fmt: skip


# a Hugging Face Llama under tensor parallel, saved at its last step, for the export test
LLAMA = {"name": "llama-tp2", "model": "llama", "model_kwargs": {}, "strategy": {"tensor_parallel_size": 2},
         "steps": 2, "batch_size": 4, "data_parallel_size": 1,
         "callbacks": [{"kind": "ModelCheckpoint", "every_n_train_steps": 2, "save_top_k": -1}]}  # fmt: skip


def _saver(directory: Optional[Path]) -> dict[str, Any]:
    # top-1 (the older one is removed at each save) plus last.ckpt, every 2 steps (None: in the scenario's directory)
    saver = {"kind": "ModelCheckpoint", "every_n_train_steps": 2, "save_top_k": 1, "save_last": True}
    return {**saver, "dirpath": str(directory)} if directory is not None else saver


@pytest.fixture(scope="module")
def safety(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Group 1: saves at steps 2 (step=2.ckpt, last.ckpt) and 4 (step=4.ckpt, then last.ckpt), where rank 1 is
    SIGKILLed inside its 4th save. Group 2: loads damaged copies of step=4.ckpt (errors expected), resumes from
    ``last``, and runs a save/resume with ``async_checkpoint=True``."""
    import os

    from lightning_hybrid.checkpoint.io import KILL_IN_SAVE_ENV

    root = tmp_path_factory.mktemp("safety")
    directory = root / "checkpoints"
    killing = {**os.environ, KILL_IN_SAVE_ENV: "1:4"}  # this group's alone (see launch)
    killed = launch(2, [_dp2("killed", callbacks=[_saver(directory)])], root / "group1", timeout=300, environ=killing)
    from lightning_hybrid.checkpoint import read_meta

    after_kill = {  # before group 2 saves into the same directory
        "staging_left": (directory / ".last.ckpt.partial").is_dir(),
        "last_step": read_meta(directory / "last.ckpt")["global_step"],
        "visible": sorted(p.name for p in directory.glob("*.ckpt")),
    }
    damaged = {}
    for kind in ("missing-shard", "truncated", "flipped"):
        damaged[kind] = root / f"{kind}.ckpt"
        shutil.copytree(directory / "epoch=0-step=4.ckpt", damaged[kind])
    (damaged["missing-shard"] / "__1_0.distcp").unlink()
    shard = damaged["truncated"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    flip_byte(damaged["flipped"] / "__1_0.distcp")  # in the middle of rank 1's shard
    # the same directory with one byte of last.ckpt flipped: ckpt_path="last" must resume from step=4 (the newest
    # valid one; copytree keeps the modification times)
    corrupt_last = root / "corrupt-last"
    shutil.copytree(directory, corrupt_last)
    flip_byte(corrupt_last / "last.ckpt" / "__0_0.distcp")
    scenarios = [
        _dp2("error-missing-shard", resume_from=str(damaged["missing-shard"]), expect_error=True),
        _dp2("error-truncated", resume_from=str(damaged["truncated"]), expect_error=True),
        _dp2("error-flipped", resume_from=str(damaged["flipped"]), expect_error=True),
        _dp2(
            "error-hidden-size",
            resume_from=str(directory / "epoch=0-step=4.ckpt"),
            model_kwargs={**SMALL, "n_embd": 64},
            expect_error=True,
        ),
        _dp2("resume-last", resume_from="last", callbacks=[_saver(directory)]),
        _dp2("resume-last-past-corrupt", resume_from="last", callbacks=[_saver(corrupt_last)]),
        # saves last.ckpt at step 2, then each save of it after the fit meets a full disk on one rank
        _dp2("disk-full", steps=3, callbacks=[_saver(None)], after_fit="tests.checkpoint_faults:disk_full_matrix"),
        _dp2("async-resume", strategy={"zero_stage": 1, "async_checkpoint": True}, resume_after=3),
        # a persistent buffer that holds each rank's rank, on two tensor-parallel peers (copies of one replica, which
        # must agree; data-parallel replicas' buffers are saved from the first replica): the save must refuse
        {
            **_dp2(
                "error-conflicting-values",
                steps=2,
                expect_error=True,
                callbacks=[{"kind": "ModelCheckpoint", "every_n_train_steps": 1, "save_top_k": -1}],
            ),
            "model": "nanogpt_rank_marker",
            "strategy": {"tensor_parallel_size": 2, "zero_stage": 1},
            "data_parallel_size": 1,
        },
        # the same buffer on two data-parallel replicas: saved from the first one, as Lightning's DDP saves rank 0's
        {
            **_dp2(
                "rank-marker-dp2-saves",
                steps=2,
                callbacks=[{"kind": "ModelCheckpoint", "every_n_train_steps": 1, "save_top_k": -1}],
            ),
            "model": "nanogpt_rank_marker",
        },
        LLAMA,
        *ASYNC_TENSOR_PARALLEL2,
    ]
    group = launch(2, scenarios, root / "group2", timeout=600)
    reference = run_reference({"model": "nanogpt", "model_kwargs": SMALL, "data_parallel_size": 2, "batch_size": 16,
                               "steps": SMALL_STEPS})  # fmt: skip
    return {"killed": killed, "after_kill": after_kill, "group": group, "reference": reference, "root": root}


def _assert_continues_reference(result: dict[str, Any], reference: dict[str, Any], start: int) -> None:
    assert len(result["losses"]) == SMALL_STEPS - start, f"expected a resume at step {start}"
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"][start:]), start=start + 1):
        assert abs(got - want) / abs(want) <= TOL, f"step {step}: loss {got}, uninterrupted single process {want}"
    for name, want in reference["params"].items():
        err = relative_error(result["params"][name], want)
        assert err <= TOL, f"{name} after step {SMALL_STEPS}: relative error {err:.2e}"


@pytest.mark.timeout(900)
def test_killed_save_leaves_previous_checkpoint_and_last_intact(safety: dict[str, Any]) -> None:
    after_kill = safety["after_kill"]
    assert safety["killed"].returncode != 0, "rank 1 should have been killed inside the save"
    assert after_kill["staging_left"], "the killed save should have stopped in its staging directory"
    assert after_kill["last_step"] == 2, "last.ckpt must still be the step-2 checkpoint"
    # save_top_k=1 removed step=2.ckpt once step=4.ckpt was complete; the staging directory is not a *.ckpt
    assert after_kill["visible"] == ["epoch=0-step=4.ckpt", "last.ckpt"]
    # ckpt_path="last" resumes from step 2 and continues exactly as an uninterrupted run
    _assert_continues_reference(safety["group"].get("resume-last"), safety["reference"], start=2)


@pytest.mark.timeout(900)
def test_last_resumes_from_the_newest_valid_checkpoint(safety: dict[str, Any]) -> None:
    """``last.ckpt`` (step 2) has a flipped byte: ``ckpt_path="last"`` resumes from the newest checkpoint that passes
    its integrity check, ``epoch=0-step=4.ckpt``, and continues exactly as an uninterrupted run."""
    _assert_continues_reference(safety["group"].get("resume-last-past-corrupt"), safety["reference"], start=4)


@pytest.mark.timeout(900)
def test_a_full_disk_during_a_save_fails_on_every_rank_and_commits_nothing(safety: dict[str, Any]) -> None:
    """After a fit that saved ``last.ckpt`` at step 2 (of 3), saves of ``last.ckpt`` meet a full disk on one rank
    (synchronous: in rank 1's shard, rank 0's meta.pt, rank 0's commit record; asynchronous: in rank 1's shard, in
    rank 0's final rename). Every rank raises the same error, naming the rank and the ``OSError``, within seconds;
    ``last.ckpt`` stays the step-2 checkpoint, whole and picked by ``ckpt_path="last"``; no partial directory stays."""
    from tests.checkpoint_faults import MATRIX

    result = safety["group"].get("disk-full")["after_fit"]
    per_rank = result["per_rank"]
    assert len(per_rank) == 2
    for rank, outcome in enumerate(per_rank):
        assert [(r["mode"], r["point"], r["rank"]) for r in outcome["records"]] == MATRIX
        for record in outcome["records"]:
            where = f"{record['mode']} save, full disk at {record['point']} on rank {record['rank']}"
            error = record["error"] or ""
            heading = f"CheckpointError: Saving checkpoint {result['last']} failed (the disk is full):"
            assert error.startswith(heading), f"rank {rank}, {where}: {error or 'no error'}"
            assert f"rank {record['rank']}: OSError: [Errno 28] No space left on device" in error, (rank, where, error)
            assert record["seconds"] < 60, f"rank {rank} took {record['seconds']:.0f} s to report a {where}"
        assert outcome["step_before"] == outcome["step_after"] == 2 and outcome["global_step"] == 3
        assert outcome["record_unchanged"] and outcome["problems"] == [], outcome
        assert outcome["chosen"] == result["last"]
        assert outcome["left"] == ["epoch=0-step=2.ckpt", "last.ckpt"], outcome["left"]
    assert [r["error"] for r in per_rank[0]["records"]] == [r["error"] for r in per_rank[1]["records"]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("error-missing-shard", r"file __1_0\.distcp is missing"),
        ("error-truncated", r"file __0_0\.distcp is truncated"),
        ("error-flipped", r"file __1_0\.distcp is corrupt: its sha256 is"),
        ("error-hidden-size", r"`model\.wte\.weight`: the checkpoint holds shape \[128, 32\], the model \[128, 64\]"),
    ],
)
def test_bad_checkpoint_raises_a_clear_error_on_every_rank(safety: dict[str, Any], name: str, match: str) -> None:
    import re

    errors = safety["group"].expected_errors(name)
    assert len(errors) == 2, f"every rank must raise (got {len(errors)}):\n{errors}"
    for text in errors:
        assert text.startswith("CheckpointError") and re.search(match, text), text


@pytest.mark.timeout(900)
def test_save_refuses_two_values_under_one_key(safety: dict[str, Any]) -> None:
    """Two ranks about to write different values under one key (here a buffer set to each rank's rank): DCP would
    keep either copy silently; the save raises the same error on every rank instead, before writing anything."""
    errors = safety["group"].expected_errors("error-conflicting-values")
    assert len(errors) == 2, f"every rank must raise (got {len(errors)}):\n{errors}"
    for text in errors:
        assert text.startswith("CheckpointError: Refusing to save"), text
        assert "`state_dict.rank_marker`: rank 0 and rank 1 hold different values" in text, text
    assert errors[0] == errors[1]


@pytest.mark.timeout(900)
def test_data_parallel_replicas_buffers_are_saved_from_the_first_replica(safety: dict[str, Any]) -> None:
    """A buffer each data-parallel replica sets differently (BatchNorm running statistics, here each rank's rank) is
    one value in the checkpoint, the first replica's, as Lightning's DDP saves rank 0's."""
    from lightning_hybrid.checkpoint.format import SafeFileSystemReader

    safety["group"].get("rank-marker-dp2-saves")
    checkpoint = next(safety["group"].out_dir.glob("rank-marker-dp2-saves/*step=2.ckpt"))
    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    assert "state_dict.rank_marker" in metadata.state_dict_metadata
    import torch.distributed.checkpoint as dcp

    state = {"state_dict.rank_marker": torch.full((1,), -1.0)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), no_dist=True)
    assert state["state_dict.rank_marker"].item() == 0.0


@pytest.mark.timeout(900)
def test_async_save_resumes_exactly(safety: dict[str, Any]) -> None:
    """Saved in the background at step 3 (the end of the first fit waits for it), resumed in a new Trainer: the
    worker records both fits' losses, steps 1-6, which equal an uninterrupted single-process run's."""
    _assert_continues_reference(safety["group"].get("async-resume"), safety["reference"], start=0)


# ---------------------------------------------------------------- async saves under tensor parallel
# ZeRO-1/2's optimizer state is saved as views into the flat shards; under tensor parallel they are DTensors, which
# DCP's asynchronous staging deep-copies: each is saved in the background at step 3 and resumed in a new Trainer
ASYNC_TP2 = {"name": "async-resume-tp2", "model": "nanogpt", "model_kwargs": SMALL, "batch_size": 16,
             "steps": SMALL_STEPS, "data_parallel_size": 1, "resume_after": 3,
             "strategy": {"tensor_parallel_size": 2, "zero_stage": 1, "async_checkpoint": True}}  # fmt: skip
ASYNC_TENSOR_PARALLEL2 = [ASYNC_TP2]  # in the safety fixture's 2-process group
ASYNC_3D = {**_dp2("async-resume-tp2-pp2-dp2", resume_after=3),
            "strategy": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 2,
                         "zero_stage": 1, "async_checkpoint": True}}  # fmt: skip
share(8, [ASYNC_3D])


@pytest.mark.timeout(2400)  # may wait for the session's shared 8-process launch
@pytest.mark.parametrize("name", [ASYNC_TP2["name"], ASYNC_3D["name"]])
def test_async_save_under_tensor_parallel_resumes_exactly(safety: dict[str, Any], shared_groups, name: str) -> None:
    """An asynchronous save at step 3 at tp=2 and at 2x2x2 (ZeRO-1), resumed in a new Trainer: steps 1-6 equal an
    uninterrupted single-process run's (the same global batches)."""
    if name == ASYNC_3D["name"]:
        result, reference = shared_groups(8).get(name), safety["reference"]
    else:
        result = safety["group"].get(name)
        reference = run_reference({"model": "nanogpt", "model_kwargs": SMALL, "data_parallel_size": 1,
                                   "batch_size": 16, "steps": SMALL_STEPS})  # fmt: skip
    _assert_continues_reference(result, reference, start=0)


def test_dcp_ready_dtensor_views_deep_copy_and_alias_the_live_memory() -> None:
    """One process: a DTensor over a view into a flat buffer at an offset (a ZeRO shard's piece) cannot be deep-copied
    as torch builds it (what DCP's async staging does); ``dcp_ready``'s version can, and still writes through."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_hybrid.checkpoint.tensors import dcp_ready

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        flat = torch.arange(100.0)
        piece = DTensor.from_local(flat[40:64].view(6, 4), mesh, [Shard(0)], run_check=False, shape=(6, 4),
                                   stride=(4, 1))  # fmt: skip
        with pytest.raises(RuntimeError, match="invalid python storage"):
            copy.deepcopy(piece)  # torch's own limit: the reason for the re-wrap
        ready = dcp_ready({"w": piece})["w"]
        assert torch.equal(copy.deepcopy(ready).to_local(), flat[40:64].view(6, 4))
        ready.to_local().fill_(-1.0)  # a load into it fills the live buffer
        assert torch.equal(flat[40:64], torch.full((24,), -1.0)) and flat[39] == 39 and flat[64] == 64
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- consolidation and Hugging Face export
@pytest.mark.timeout(900)
def test_consolidated_weights_equal_the_gathered_parameters(
    reshard_groups: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The (tp=2, pp=2, dp=2) checkpoint at step 6, consolidated without any process group, is exactly the
    parameters gathered from the ranks after step 6, and loads strictly into the single-device module; consolidated
    into one ``.ckpt`` file, ``NanoGPT.load_from_checkpoint`` rebuilds the module with those parameters."""
    from safetensors.torch import load_file

    from lightning_hybrid.checkpoint import consolidate
    from tests.harness import build_module

    group = reshard_groups["source"]
    checkpoint = next(group.out_dir.glob(f"reshard-source/*step={STEPS}.ckpt"))
    out = consolidate(checkpoint, tmp_path_factory.mktemp("consolidated"))
    weights = load_file(out / "model.safetensors")
    gathered = group.get("reshard-source")["params"]
    assert gathered.keys() <= weights.keys()
    for name, want in gathered.items():
        assert torch.equal(weights[name], want), f"{name} differs from the gathered parameter"
    module = build_module("nanogpt", **MODEL)
    module.load_state_dict(weights, strict=True)

    from examples.nanogpt import NanoGPT

    loaded = NanoGPT.load_from_checkpoint(consolidate(checkpoint, out / "full.ckpt"))
    assert loaded.hparams.n_layer == MODEL["n_layer"] and loaded.hparams.bias == MODEL["bias"]
    state = loaded.state_dict()
    for name, want in gathered.items():
        assert torch.equal(state[name], want), f"{name} in the .ckpt differs from the gathered parameter"


@pytest.mark.timeout(900)
def test_hugging_face_export_loads_with_from_pretrained(safety: dict[str, Any]) -> None:
    """``lightning-hybrid consolidate`` on a tensor-parallel Llama checkpoint writes a folder that ``from_pretrained``
    loads; its logits equal the single-device module's with the gathered parameters."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_clean_exit, console_script
    from tests.harness import build_module, make_dataset

    group = safety["group"]
    checkpoint = next(group.out_dir.glob("llama-tp2/*step=2.ckpt"))
    out = safety["root"] / "llama-export"
    proc = console_script("consolidate", str(checkpoint), str(out), timeout=120)
    assert_clean_exit(proc)
    assert proc.stdout.strip().endswith("model.safetensors"), proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    module = build_module("llama").eval()
    module.load_state_dict(group.get("llama-tp2")["params"], strict=True)
    inputs = torch.stack([make_dataset()[i][0] for i in range(4)])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=inputs).logits, module(inputs))


# ---------------------------------------------------------------- memory during a save
MEMORY_BUFFER = 16 * 2**20  # planning metadata, one tensor serialized at a time, the interpreter's own noise


@pytest.mark.timeout(600)
def test_save_memory_grows_by_at_most_the_own_shard(tmp_path: Path) -> None:
    """2 ranks (dp=2, ZeRO-1), a 3.2M-parameter nanoGPT: while ``trainer.save_checkpoint`` runs, each rank's peak
    resident memory exceeds what it held before by no more than the bytes it writes (its shards) plus a fixed buffer.
    Gathering the model or the optimizer state on one rank (13 MB of weights, 39 MB of Adam state and master) would
    exceed it."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[log.find("Traceback") :][:4000] if "Traceback" in log else log[-4000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"memory{rank}.json").read_text())
        growth = record["peak"] - record["before"]
        assert record["written"] > 8 * 2**20, record  # the model is large enough to see a gather
        assert growth <= record["written"] + MEMORY_BUFFER, (
            f"rank {rank}: memory grew by {growth / 2**20:.1f} MiB during the save; it writes"
            f" {record['written'] / 2**20:.1f} MiB (+ {MEMORY_BUFFER / 2**20:.0f} MiB buffer)"
        )


def _measure_save_memory(out: Path) -> None:
    """Run by each rank of the memory test (``torchrun ... tests/test_checkpoint.py OUT``)."""
    import gc
    import json
    import os
    import threading
    import time

    import lightning as L

    from lightning_hybrid import HybridStrategy
    from tests.harness import build_module, make_dataset, trainer_kwargs

    torch.set_num_threads(1)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    class MeasureSave(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            gc.collect()
            before, peak, stop = rss(), [0], threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss())
                    time.sleep(0.0005)

            sampler = threading.Thread(target=sample)
            sampler.start()
            trainer.save_checkpoint(out / "memory.ckpt")
            stop.set()
            sampler.join()
            rank = trainer.global_rank
            written = sum(f.stat().st_size for f in (out / "memory.ckpt").glob(f"__{rank}_*.distcp"))
            record = {"before": before, "peak": max(peak[0], rss()), "written": written}
            (out / f"memory{rank}.json").write_text(json.dumps(record))

    module = build_module("nanogpt", n_layer=4, n_embd=256, n_head=4, bias=False)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(zero_stage=1), callbacks=[MeasureSave()],
                        **trainer_kwargs(1))  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)


if __name__ == "__main__":
    import sys

    _measure_save_memory(Path(sys.argv[1]))
