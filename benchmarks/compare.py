"""Side-by-side step-time comparisons: HybridStrategy (A) against what a user would pick instead (B), alternating.

Each comparison runs in a ``torchrun`` group of CPU processes (gloo, one thread each). Per round, A trains a few
steps from a fresh start, then B does the same (A B A B ...), so a slow drift of the shared machine hits both. A
round's value is the median of its measured steps (the slowest rank's time per step); the report gives the median
over rounds with the min-max, and the ratio A/B as the median of the per-round ratios. In the last round, the
A run trains one extra step that counts the communication (``lightning_hybrid.monitoring.comm.CommunicationMeter``)
and reads the model-state bytes and the pipeline bubble; when A misses its target, one more A run is profiled.

Usage: ``python -m benchmarks.run_all`` (this module is its engine; ``--worker`` is the per-process entry).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Sizes chosen so one step takes ~0.2-1 s on one core of the 2-core test machine (measured: 4 blocks of width 256 on
# 8 sequences of 64 tokens ~0.22 s for forward, backward and AdamW).
MODELS: dict[str, dict[str, Any]] = {
    "dense": {"vocab_size": 128, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256},
    "deep": {"vocab_size": 128, "block_size": 64, "n_layer": 8, "n_head": 4, "n_embd": 256},
    # compute negligible: what remains is the Python of strategy and schedule per micro-batch
    "tiny": {"vocab_size": 64, "block_size": 8, "n_layer": 4, "n_head": 2, "n_embd": 16},
}
SMOKE_MODELS: dict[str, dict[str, Any]] = {
    "dense": {"vocab_size": 64, "block_size": 8, "n_layer": 4, "n_head": 2, "n_embd": 16},
    "deep": {"vocab_size": 64, "block_size": 8, "n_layer": 8, "n_head": 2, "n_embd": 16},
    "tiny": {"vocab_size": 64, "block_size": 8, "n_layer": 4, "n_head": 2, "n_embd": 16},
}
# On GPUs the CPU sizes would measure launch latency, not training: GPT-2 small width (the pipeline runs' `deep`
# model has 16 blocks so that 8 stages of interleaved pp=4 divide it).
GPU_MODELS: dict[str, dict[str, Any]] = {
    "dense": {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "deep": {"vocab_size": 50304, "block_size": 1024, "n_layer": 16, "n_head": 12, "n_embd": 768},
    "tiny": SMOKE_MODELS["tiny"],
}


def models_for(*, smoke: bool, device: str) -> dict[str, dict[str, Any]]:
    """The model sizes of a run: tiny ones for the smoke run, GPT-2 small width on GPUs, CPU-sized otherwise."""
    return SMOKE_MODELS if smoke else GPU_MODELS if device == "cuda" else MODELS


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"]
VIRTUAL = {"interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}
LIGHTNING_TARGET = 1.00  # step time <= the Lightning strategy that does the same job
PLAIN_TARGET = 1.05  # step time <= 1.05x the plain-torch script of the same layout


def hybrid(**strategy: Any) -> dict[str, Any]:
    return {"kind": "hybrid", "strategy": strategy}


def _pipeline(world: int, schedule: str, microbatches: int) -> dict[str, Any]:
    return {
        "name": f"pp{world}_{schedule}",
        "group": f"pp{world}",
        "world": world,
        "model": "deep",
        "global_batch": 16,
        "a": hybrid(pipeline_parallel_size=world, pipeline_schedule=schedule, virtual_pipeline_size=VIRTUAL.get(
            schedule, 1), num_microbatches=microbatches, zero_stage=0),
        "b": {"kind": "plain_pipeline", "schedule": schedule, "microbatches": microbatches},
        "target": PLAIN_TARGET,
        "layout": f"pp={world}, {schedule}, m={microbatches}",
    }  # fmt: skip


def comparisons(device: str = "cpu") -> list[dict[str, Any]]:
    """Every comparison, grouped by the process group it runs in (``group``). On GPUs (``device="cuda"``) the
    DeepSpeed references are Lightning's ``DeepSpeedStrategy`` and ZeRO-3 is also compared with ``FSDPStrategy``
    (Lightning refuses both on CPU, where the DeepSpeed reference is its engine)."""
    out: list[dict[str, Any]] = [
        {"name": "dp2_zero0", "a": hybrid(zero_stage=0), "b": {"kind": "ddp"}, "target": LIGHTNING_TARGET,
         "layout": "dp=2, ZeRO-0", "reference": 'Lightning `"ddp"`', "rounds": 7},  # a 1.00x target: more rounds
        {"name": "dp2_zero1", "a": hybrid(zero_stage=1), "b": {"kind": "deepspeed", "zero_stage": 1},
         "target": LIGHTNING_TARGET, "layout": "dp=2, ZeRO-1", "reference": "DeepSpeed engine ZeRO-1"},
        {"name": "dp2_zero2", "a": hybrid(zero_stage=2), "b": {"kind": "deepspeed", "zero_stage": 2},
         "target": LIGHTNING_TARGET, "layout": "dp=2, ZeRO-2", "reference": "DeepSpeed engine ZeRO-2"},
        {"name": "dp2_zero3", "a": hybrid(zero_stage=3), "b": {"kind": "model_parallel_fsdp"},
         "target": LIGHTNING_TARGET, "layout": "dp=2, ZeRO-3", "reference": "ModelParallelStrategy (FSDP2)"},
        {"name": "tp2", "a": hybrid(tensor_parallel_size=2, zero_stage=0), "b": {"kind": "model_parallel_tp"},
         "target": LIGHTNING_TARGET, "layout": "tp=2, automatic plan",
         "reference": "ModelParallelStrategy, TP plan by hand"},
        # compile=True against the same layout eager: the first step (the compile itself) is never timed, and later
        # rounds reuse the process's compiled graphs; the target is not being slower than eager beyond noise
        {"name": "dp2_zero1_compile", "a": hybrid(zero_stage=1, compile=True), "b": hybrid(zero_stage=1),
         "target": PLAIN_TARGET, "layout": "dp=2, ZeRO-1, compile=True", "reference": "the same, compile=False"},
        {"name": "tp2_compile", "a": hybrid(tensor_parallel_size=2, zero_stage=0, compile=True),
         "b": hybrid(tensor_parallel_size=2, zero_stage=0), "target": PLAIN_TARGET,
         "layout": "tp=2, automatic plan, compile=True", "reference": "the same, compile=False"},
    ]  # fmt: skip
    if device == "cuda":
        for c in out:
            if c["b"]["kind"] == "deepspeed":
                stage = c["b"]["zero_stage"]
                c["b"] = {"kind": "lightning_deepspeed", "zero_stage": stage}
                c["reference"] = f"Lightning `DeepSpeedStrategy` ZeRO-{stage}"
        out.insert(4, {"name": "dp2_zero3_fsdp1", "a": hybrid(zero_stage=3), "b": {"kind": "lightning_fsdp"},
                       "target": LIGHTNING_TARGET, "layout": "dp=2, ZeRO-3",
                       "reference": "Lightning `FSDPStrategy` (FULL_SHARD, per block)"})  # fmt: skip
    for c in out:
        c.update(group="w2", world=2, model="dense", global_batch=16)
    out += [{**_pipeline(2, s, 8), "group": "w2", "reference": "plain `torch.distributed.pipelining`"}
            for s in SCHEDULES]  # fmt: skip
    out.append(
        {"name": "host_overhead", "group": "w2", "world": 2, "model": "tiny", "global_batch": 8,
         "a": hybrid(pipeline_parallel_size=2, num_microbatches=8, zero_stage=0),
         "b": {"kind": "plain_pipeline", "schedule": "1f1b", "microbatches": 8}, "target": PLAIN_TARGET,
         "layout": "pp=2, 1f1b, m=8, tiny model", "reference": "plain `torch.distributed.pipelining`",
         "microbatches": 8, "measured": 40, "rounds": 5}
    )  # fmt: skip
    # the host-overhead row split in two: what Lightning's loop alone adds to the plain pipeline (no strategy code:
    # the floor of any Lightning strategy), and what HybridStrategy adds on top of that floor
    floor = {"kind": "lightning_pipeline", "schedule": "1f1b", "microbatches": 8}
    out += [
        {**out[-1], "name": "host_overhead_lightning_floor", "a": floor,
         "layout": "pp=2, 1f1b, m=8, tiny model: plain pipelining inside Lightning's loop, no strategy code"},
        {**out[-1], "name": "host_overhead_over_floor", "b": floor, "layout": "pp=2, 1f1b, m=8, tiny model",
         "reference": "plain `torch.distributed.pipelining` inside Lightning's loop"},
        # the floor again without its two largest per-step costs (Lightning's `self.log` and its per-batch SIGTERM
        # broadcast): an ablation, to show which parts of Lightning's loop alone exceed the 1.05x budget
        {**out[-1], "name": "host_overhead_lightning_floor_bare", "a": {**floor, "bare": True},
         "layout": "pp=2, 1f1b, m=8, tiny model: the floor without `self.log` and the per-batch SIGTERM broadcast"},
    ]  # fmt: skip
    out += [{**_pipeline(4, s, 8), "group": "pp4", "reference": "plain `torch.distributed.pipelining`"}
            for s in SCHEDULES]  # fmt: skip
    out.append(
        {"name": "3d_2x2x2", "group": "3d", "world": 8, "model": "dense", "global_batch": 16,
         "a": hybrid(tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=3, num_microbatches=4),
         "b": {"kind": "plain_3d", "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "microbatches": 4},
         "target": PLAIN_TARGET, "layout": "tp=2 x pp=2 x dp=2, ZeRO-3, 1f1b, m=4",
         "reference": "plain torch (DeviceMesh + DTensor + FSDP2 + pipelining)"}
    )  # fmt: skip
    return out


GROUPS = {"w2": 2, "pp4": 4, "3d": 8}


# -------------------------------------------------------------------------------------------------------------- worker
def _run_contestant(
    spec: dict[str, Any], model: dict[str, Any], global_batch: int, steps: int, **extra_kwargs: Any
) -> tuple[list[float], dict[str, Any]]:
    from benchmarks import plain_torch

    kind = spec["kind"]
    if kind == "plain_pipeline":
        times = plain_torch.plain_pipeline(model, global_batch=global_batch, steps=steps, schedule=spec["schedule"],
                                           microbatches=spec["microbatches"])  # fmt: skip
        return times[1:], {}
    if kind == "plain_3d":
        times = plain_torch.plain_3d(model, global_batch=global_batch, steps=steps, microbatches=spec["microbatches"],
                                     pipeline_parallel_size=spec["pipeline_parallel_size"],
                                     tensor_parallel_size=spec["tensor_parallel_size"])  # fmt: skip
        return times[1:], {}
    if kind == "deepspeed":
        times = plain_torch.deepspeed_engine(model, global_batch=global_batch, steps=steps,
                                             zero_stage=spec["zero_stage"])  # fmt: skip
        return times[1:], {}
    from benchmarks.lightning_runs import run_lightning

    # Lightning's times are end-to-end of consecutive batches: already one fewer than steps, the first excluded
    return run_lightning(spec, model, global_batch, steps=steps, **extra_kwargs)


def _slowest_rank(times: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Per step, the slowest rank's wall time (the step is done when every rank is) and the largest CPU time of a
    rank (with one core per rank, the step cannot be faster than that)."""
    everyone = _gather(times)
    return {
        "wall": [max(w for w, _ in column) for column in zip(*everyone)],
        "cpu": [max(c for _, c in column) for column in zip(*everyone)],
    }


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _worker(config_path: Path) -> None:
    import torch
    import torch.distributed as dist

    config = json.loads(config_path.read_text())
    if config.get("priority") is not None:
        from benchmarks.pipeline_bubble import _set_autogroup_nice

        _set_autogroup_nice(config["priority"])
    cuda = config.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    models = models_for(smoke=config["smoke"], device=config.get("device", "cpu"))
    warmup = config["warmup"]
    out_dir = Path(config["out_dir"])
    for comparison in config["comparisons"]:
        name = comparison["name"]
        measured, rounds = measurement(comparison, config)
        steps = 1 + warmup + measured
        model = models[comparison["model"]]
        batch = comparison["global_batch"]
        record: dict[str, Any] = {"name": name, "rounds": [], "profiled_steps": warmup + measured}
        try:
            begin = time.perf_counter()
            for round_index in range(rounds):
                row = {}
                for side in ("a", "b"):
                    if side == "a" and round_index == rounds - 1 and comparison["a"]["kind"] == "hybrid":
                        # communication, model state and bubble of A: one extra step at the end of the last round,
                        # counted by the meter and left out of the timings (the meter slows the step it counts)
                        times, extra = _run_contestant(comparison[side], model, batch, steps + 1, meter_step=steps)
                        times = times[:-1]
                        record["theory_inputs"] = _gather({k: v for k, v in extra.items() if k != "profile"})
                    else:
                        times, extra = _run_contestant(comparison[side], model, batch, steps)
                    row[side] = _slowest_rank(times[warmup:])
                    if cuda:
                        row[side]["peak_memory_bytes"] = max(_gather(extra.get("peak_memory_bytes") or 0))
                    dist.barrier()
                record["rounds"].append(row)
            a = [statistics.median(r["a"]["wall"]) for r in record["rounds"]]
            b = [statistics.median(r["b"]["wall"]) for r in record["rounds"]]
            ratio = statistics.median(x / y for x, y in zip(a, b))
            # the smoke run only checks that everything runs: no profiling there unless asked for
            if (ratio > comparison["target"] and not config["smoke"]) or config.get("profile_all"):
                _, extra = _run_contestant(comparison["a"], model, batch, steps, profile=True)
                record["profile"] = {"a": _gather(extra["profile"])}
                if comparison["b"]["kind"] in ("ddp", "model_parallel_fsdp", "model_parallel_tp"):
                    _, extra_b = _run_contestant(comparison["b"], model, batch, steps, profile=True)
                    record["profile"]["b"] = _gather(extra_b["profile"])
            record["seconds"] = time.perf_counter() - begin
        except Exception:
            record["error"] = traceback.format_exc()
            if dist.get_rank() == 0:
                (out_dir / f"{name}.pkl").write_bytes(pickle.dumps(record))
            raise  # ranks may be out of step after a failure: stop the group rather than risk a hang
        if dist.get_rank() == 0:
            (out_dir / f"{name}.pkl").write_bytes(pickle.dumps(record))
        print(f"[rank {dist.get_rank()}] {name} done in {record['seconds']:.0f} s", flush=True)


# -------------------------------------------------------------------------------------------------------------- launch
def launch_group(
    group: str,
    selected: list[dict[str, Any]],
    *,
    smoke: bool,
    warmup: int,
    measured: int,
    rounds: int,
    timeout: float,
    priority: Optional[int],
    profile_all: bool = False,
    device: str = "cpu",
) -> dict[str, dict[str, Any]]:
    """Run ``selected`` (all of one group) in one ``torchrun`` group; the records by name (failed ones carry an
    ``error``; ones the group never reached are missing)."""
    world = selected[0]["world"]
    with tempfile.TemporaryDirectory(prefix=f"bench_{group}_") as work:
        config = {"comparisons": selected, "smoke": smoke, "warmup": warmup, "measured": measured, "rounds": rounds,
                  "out_dir": work, "priority": priority, "profile_all": profile_all, "device": device}  # fmt: skip
        config_path = Path(work) / "config.json"
        config_path.write_text(json.dumps(config))
        env = {**os.environ, "LH_BENCH_DEVICE": device,
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
        if device == "cpu":  # one thread per rank: the ranks share the cores
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               "-m", "benchmarks.compare", "--worker", str(config_path)]  # fmt: skip
        print(f"launching {world} processes: {', '.join(c['name'] for c in selected)}", flush=True)
        log = ""
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            log, failed = proc.stdout + proc.stderr, proc.returncode != 0
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            log, failed = f"TIMEOUT after {timeout:.0f} s (a hang?)\n{out}", True
        records = {}
        for c in selected:
            path = Path(work) / f"{c['name']}.pkl"
            if path.exists():
                records[c["name"]] = pickle.loads(path.read_bytes())
        if failed:
            print(log[-6000:], file=sys.stderr)
            for c in selected:
                records.setdefault(c["name"], {"name": c["name"], "error": "not reached: " + log[-3000:]})
        return records


def measurement(comparison: dict[str, Any], settings: dict[str, Any]) -> tuple[int, int]:
    """Measured steps per round and rounds of ``comparison``: the run's settings, or the comparison's own
    ``measured``/``rounds`` where it sets them (a step of a few ms needs more steps per round than a step of 100 ms
    for the same share of timer and scheduler noise; a row with a target of 1.00x more rounds). A smoke run keeps
    its own one-step settings."""
    if settings.get("smoke"):
        return settings["measured"], settings["rounds"]
    return comparison.get("measured", settings["measured"]), comparison.get("rounds", settings["rounds"])


def summarise(comparison: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Medians, min-max and the paired ratio of one comparison's rounds."""
    if "error" in record:
        return {"error": record["error"]}
    out: dict[str, Any] = {}
    for clock, prefix in (("wall", ""), ("cpu", "cpu_")):
        a = [statistics.median(r["a"][clock]) for r in record["rounds"]]
        b = [statistics.median(r["b"][clock]) for r in record["rounds"]]
        ratios = [x / y for x, y in zip(a, b)]
        out.update({
            f"{prefix}a_median": statistics.median(a), f"{prefix}a_min": min(a), f"{prefix}a_max": max(a),
            f"{prefix}b_median": statistics.median(b), f"{prefix}b_min": min(b), f"{prefix}b_max": max(b),
            f"{prefix}ratio": statistics.median(ratios), f"{prefix}ratio_min": min(ratios),
            f"{prefix}ratio_max": max(ratios),
        })  # fmt: skip
    for side in ("a", "b"):  # GPU runs: the largest peak memory of a rank over the rounds
        peaks = [r[side].get("peak_memory_bytes") for r in record["rounds"]]
        if any(peaks):
            out[f"{side}_peak_memory_bytes"] = max(x or 0 for x in peaks)
    out.update(target=comparison["target"], met=out["ratio"] <= comparison["target"], rounds=len(record["rounds"]),
               steps_per_round=len(record["rounds"][0]["a"]["wall"]), seconds=record.get("seconds"))  # fmt: skip
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, required=True)
    args = parser.parse_args(argv)
    _worker(args.worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
