"""Runs a list of scenarios in one set of launched processes (``torchrun``), so start-up is paid once.

Usage: python -m torch.distributed.run --nproc_per_node N tests/worker.py SPEC.json OUT_DIR
Each scenario's results (rank 0) land in OUT_DIR/<name>.pt; an error is recorded instead of stopping the rest.
A scenario may set "timeout_s" (those expecting an error get 300 s): past it, the rank dumps its stacks and exits.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_hybrid import HybridPrecision, HybridStrategy, process_groups, topology  # noqa: E402
from tests.harness import Recorder, build_module, full_parameters, make_dataset, trainer_kwargs  # noqa: E402


def run(scenario: dict, out_dir: Path) -> None:
    world = int(os.environ["WORLD_SIZE"])
    model_kwargs = scenario.get("model_kwargs", {})
    module = None if scenario.get("init_module") else build_module(scenario["model"], **model_kwargs)
    # a string is the registered name, as a user passes it: `Trainer(strategy="hybrid")`
    spec = scenario["strategy"]
    reads = None
    if scenario.get("pretrained"):  # start from pretrained weights rank 0 writes now (tests/pretrained_source.py)
        from tests.pretrained_source import ReadCounter, prepare

        spec, reads = {**spec, "pretrained_weights": prepare(scenario, out_dir)}, ReadCounter()
    strategy = spec if isinstance(spec, str) else HybridStrategy(**spec)
    dataset = make_dataset(scenario.get("dataset", "tokens"))
    loader = torch.utils.data.DataLoader(dataset, batch_size=scenario["batch_size"], shuffle=True)
    recorder = Recorder()
    kwargs = {**trainer_kwargs(scenario["steps"]), **scenario.get("trainer", {})}
    if scenario.get("callbacks") or scenario.get("resume_after"):
        kwargs["enable_checkpointing"] = True
    # Lightning's default ModelCheckpoint writes under default_root_dir (the working directory unless given): the
    # scenario's own, or concurrent launches pick the same `epoch=0-step=2-v1.ckpt` and one removes the other's
    # partial directory while it writes. Beside the scenario's directory, whose listing some tests check
    kwargs.setdefault("default_root_dir", str(out_dir / "default_roots" / scenario["name"]))
    if scenario.get("logger") == "csv":
        from lightning.pytorch.loggers import CSVLogger

        kwargs["logger"] = CSVLogger(save_dir=str(out_dir / scenario["name"]), name="logs")
    if scenario.get("precision_plugin"):
        kwargs["plugins"] = [HybridPrecision(**scenario["precision_plugin"])]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, callbacks=[recorder], **kwargs)
    strategy = trainer.strategy
    if module is None:  # built as Lightning documents for big models: `with trainer.init_module(empty_init=True)`
        with trainer.init_module(empty_init=True):
            module = build_module(scenario["model"], **model_kwargs)
    probe = _precision_probes(trainer, scenario)
    # the recorder averages losses over the data dimension, which exists once the strategy has set up the mesh
    recorder.data_group = None

    class _Bind(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            data = trainer.strategy.device_mesh["data"]
            recorder.data_group, recorder.data_size = data.get_group(), data.size()

    trainer.callbacks.insert(0, _Bind())
    peak = None
    if scenario.get("peak_memory"):
        from tests.bucket_models import PeakGradientBytes

        peak = PeakGradientBytes()
        trainer.callbacks.insert(0, peak)  # ahead of the recorder, whose first-step gradient gather is no gradient
    start = _StartParameters() if scenario.get("record_start_params") else None
    if start is not None:
        trainer.callbacks.append(start)  # the weights a resumed fit starts from (e.g. a DeepSpeed hand-over)
    metered = _MeteredStep(scenario["metered_step"]) if "metered_step" in scenario else None
    if metered is not None:
        trainer.callbacks.append(metered)
    counter = _CollectiveCounter(strategy) if scenario.get("count_collectives") else None
    if counter is not None:
        trainer.callbacks.append(counter)
    for callback in scenario.get("callbacks", []):
        trainer.callbacks.append(_make_callback(callback, out_dir / scenario["name"]))
    val_loader = None
    val_history: list[float] = []
    if scenario.get("validate"):

        class _ValHistory(L.Callback):
            def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                if "val_loss" in trainer.callback_metrics:
                    val_history.append(float(trainer.callback_metrics["val_loss"]))

        trainer.callbacks.append(_ValHistory())
        val_loader = torch.utils.data.DataLoader(make_dataset(), batch_size=scenario["batch_size"])
        trainer.limit_val_batches = scenario["validate"]
        trainer.val_check_interval = scenario.get("val_check_interval", 1.0)
    resume_after = scenario.get("resume_after")
    if resume_after:
        # a ModelCheckpoint saves at step `resume_after` (inside the loop, as in real runs); the run stops there, and
        # a new module, strategy and Trainer resume from that checkpoint to the full step count
        from lightning.pytorch.callbacks import ModelCheckpoint

        directory = out_dir / scenario["name"]
        saver = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=resume_after, save_top_k=-1)
        trainer.callbacks.append(saver)
        trainer.fit_loop.epoch_loop.max_steps = resume_after
        trainer.fit(module, train_dataloaders=loader)
        path = next(directory.glob(f"*step={resume_after}*.ckpt"))
        module = build_module(scenario["model"], **{**scenario.get("model_kwargs", {}), "learning_rate": 0.5})
        strategy = HybridStrategy(**scenario["strategy"])
        if scenario.get("precision_plugin"):  # a fresh plugin: its loss scale must come from the checkpoint
            kwargs["plugins"] = [HybridPrecision(**scenario["precision_plugin"])]
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, callbacks=[_Bind(), recorder], **kwargs
        )
        probe = _precision_probes(trainer, scenario)  # records the resumed steps only
        recorder.grads_locked = True
        trainer.fit(module, train_dataloaders=loader, ckpt_path=str(path))
    elif scenario.get("resume_from"):
        # resume from a checkpoint saved by an earlier scenario or group, possibly in another layout: "last", an
        # absolute path, or a glob under this group's output directory
        ckpt = scenario["resume_from"]
        if ckpt != "last" and not os.path.isabs(ckpt):
            ckpt = str(next(out_dir.glob(ckpt)))
        recorder.grads_locked = True
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt)
    else:
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader)
    if reads is not None:
        reads.close()
    after_fit = None
    if scenario.get("after_fit"):  # "module:function", called on every rank as function(trainer, directory)
        import importlib

        module_name, function = scenario["after_fit"].split(":")
        after_fit = getattr(importlib.import_module(module_name), function)(trainer, out_dir / scenario["name"])
    predictions = None
    if scenario.get("predict"):
        subset = torch.utils.data.Subset(make_dataset(), range(8))
        outputs = trainer.predict(module, dataloaders=torch.utils.data.DataLoader(subset, batch_size=4))
        predictions = torch.cat([o.detach().cpu() for o in outputs])
    # under pipeline parallel each rank holds its stages' parameters only: merge every rank's view
    views: list = [None] * world
    dist.all_gather_object(views, (full_parameters(module), recorder.grads))
    params = {k: v for view, _ in views for k, v in view.items()}
    start_params = None
    if start is not None:
        starts: list = [None] * world
        dist.all_gather_object(starts, start.params)
        start_params = {k: v for view in starts for k, v in view.items()}
    recorder.grads = {k: v for _, grads in views for k, v in grads.items()}
    result = {
        "losses": recorder.losses,
        "logged": recorder.logged,
        "start_params": start_params,
        "norms": recorder.norms,
        "batch_fingerprints": recorder.batch_fingerprints,
        "predictions": predictions,
        "grads": recorder.grads,
        "params": params,
        "model_state": recorder.model_state,
        "layout": strategy.layout.as_dict(),
        "local_numel": _tensor_parallel_local_numel(module),
        "sampler": _sampler_record(trainer),
        "collectives": counter.per_step if counter is not None else None,
        "after_fit": after_fit,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "val_history": val_history,
        "logged_columns": _logged_columns(out_dir / scenario["name"]),
        "checkpoints": sorted(p.name for p in (out_dir / scenario["name"]).glob("*.ckpt"))
        if scenario.get("callbacks")
        else [],
    }
    gathered = [None] * world
    dist.all_gather_object(
        gathered,
        {
            "model_state": recorder.model_state[-1] if recorder.model_state else {},
            "local_numel": result["local_numel"],
            "sampler": result["sampler"],
            "gradient_buckets": strategy.gradient_buckets,
            "metered_calls": metered.calls if metered is not None else None,
            "peak_gradient_bytes": peak.peaks if peak is not None else None,
            "verification": getattr(getattr(strategy, "_pipeline", None), "verification", None),
            "pretrained_reads": reads.summary(module) if reads is not None else None,
            "pretrained_report": getattr(strategy, "pretrained", None),
            # what the step left on the module, where it counts its calls (tests/context_models.py)
            "step_calls": getattr(module, "calls", None) if isinstance(getattr(module, "calls", None), int) else None,
            "step_after": list(getattr(module, "after", None) or []),
        },
    )
    result["per_rank"] = gathered
    if probe is not None:
        records: list = [None] * world
        dist.all_gather_object(records, probe.records)
        result["probe"] = records
    if dist.get_rank() == 0:
        torch.save(result, out_dir / f"{scenario['name']}.pt")


class _MeteredStep(L.Callback):
    """The collectives of one optimizer step (every batch it accumulates), by the communication meter: calls per
    (dimension, collective)."""

    def __init__(self, step: int) -> None:
        self.step, self.calls, self._meter = step, None, None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_hybrid.monitoring import CommunicationMeter

        if trainer.global_step == self.step and self._meter is None:
            self._meter = CommunicationMeter(trainer.strategy.device_mesh).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._meter is not None and trainer.global_step > self.step:
            self._meter.__exit__(None, None, None)
            self.calls = {f"{d}/{op}": s.calls for (d, op), s in self._meter.totals().items()}
            self._meter = None


class _StartParameters(L.Callback):
    """This rank's full parameters when training starts (after a checkpoint was loaded)."""

    params: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = full_parameters(pl_module)


class _CollectiveCounter(L.Callback):
    """Counts collectives issued on the data-parallel group during each optimizer step (gradient reduction and,
    for ZeRO-1/2, the parameter all-gather), by wrapping torch.distributed's functions."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
             "all_gather_single", "broadcast", "all_gather", "reduce_scatter")  # fmt: skip

    def __init__(self, strategy: HybridStrategy) -> None:
        self.strategy, self.per_step, self.current = strategy, [], 0
        self.originals = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        group = self.strategy.device_mesh["data"].get_group()
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original

            def wrapped(*args, _original=original, **kwargs):
                if kwargs.get("group") is group:
                    self.current += 1
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)

    def on_train_batch_start(self, *args) -> None:
        self.current = 0

    def on_train_batch_end(self, *args) -> None:
        self.per_step.append(self.current)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _precision_probes(trainer: L.Trainer, scenario: dict):
    """Scenario keys "inject_inf": {"step", "rank"}, "force_scales": [scale per step] and "probe": true or
    "warnings" (also record each step's warnings) (tests/precision_probe.py)."""
    from tests.precision_probe import ForceScale, InjectInf, StepProbe

    if scenario.get("inject_inf"):
        trainer.callbacks.append(InjectInf(**scenario["inject_inf"]))
    if scenario.get("force_scales"):
        trainer.callbacks.append(ForceScale(scenario["force_scales"]))
    if not scenario.get("probe"):
        return None
    probe = StepProbe(record_warnings=scenario.get("probe") == "warnings")
    trainer.callbacks.append(probe)
    return probe


def _logged_columns(directory: Path) -> list[str]:
    files = sorted(directory.glob("logs/version_*/metrics.csv"))
    return files[-1].read_text().splitlines()[0].split(",") if files else []


def _make_callback(spec: dict, directory: Path) -> L.Callback:
    from lightning.pytorch import callbacks

    kind = spec["kind"]
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    if kind == "ModelCheckpoint":
        kwargs.setdefault("dirpath", str(directory))
    return getattr(callbacks, kind)(**kwargs)


def _tensor_parallel_local_numel(module: torch.nn.Module) -> int:
    """Parameters this rank holds after tensor parallel, before ZeRO (what the ZeRO formula starts from)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        numel = p.numel()
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for dim_name, placement in zip(names, p.placements):
                if dim_name == "tensor" and (placement.is_shard() or type(placement).__name__ == "_StridedShard"):
                    numel //= p.device_mesh.size(names.index("tensor"))
        total += numel
    return total


def _sampler_record(trainer: L.Trainer) -> list[int]:
    if trainer.train_dataloader is None:  # after trainer.predict
        return []
    sampler = trainer.train_dataloader.sampler
    return list(iter(sampler))


# seconds a scenario that expects a configuration error may take: one that hangs instead (a rank left in a collective)
# dumps every thread's stack and exits, which stops the group, rather than waiting for the group's timeout
_ERROR_SCENARIO_TIMEOUT_S = 300


def _threads() -> int:
    """This process's live threads (gloo starts some per process group), from /proc where there is one."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return -1
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")), -1)


class _Timings:
    """One line per scenario in OUT_DIR/timings.rank<R>.tsv: wall and CPU seconds (all of this process's threads),
    threads alive after it, peak RSS so far. Quiet (a file per rank); tests/conftest.py sums them under
    ``pytest --scenario-timings``."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / f"timings.rank{os.environ.get('RANK', '0')}.tsv"
        self.wall, self.cpu = time.perf_counter(), 0.0  # the first lap's CPU includes the imports
        self._write("scenario\twall_s\tcpu_s\tthreads\tmax_rss_mb", mode="w")
        self.lap("(start-up)")

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self._write(f"{name}\t{wall - self.wall:.2f}\t{cpu - self.cpu:.2f}\t{_threads()}\t{rss:.0f}")
        self.wall, self.cpu = wall, cpu

    def _write(self, line: str, mode: str = "a") -> None:
        with self.path.open(mode) as f:
            f.write(line + "\n")


def _process_groups() -> list:
    """Every live process group of this process (the default one and the subgroups made since)."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map) if dist.is_initialized() else []


def _free_scenario_groups(before: list) -> None:
    """Destroy the process groups a scenario made (its mesh dimensions, pipeline holder groups, ...), and free them:
    a gloo group's threads stop only when the group object is freed, and later scenarios share the 2 cores with
    every thread the earlier ones left (about 9 per scenario and process). The default group, which the launch
    gathers results over and which the next scenario's strategy reuses, stays; what remains at exit is destroyed by
    the strategy's exit handler as in any run. Local, not collective: every rank does the same after every scenario,
    so group creation stays in the same order everywhere."""
    kept = {id(pg) for pg in before}
    made = [pg for pg in _process_groups() if id(pg) not in kept and pg is not dist.GroupMember.WORLD]
    if not made:
        return
    for pg in made:
        dist.destroy_process_group(pg)
    # the strategy's meshes kept for a later fit of the same layout hold their (now destroyed) groups, and with them
    # the groups' gloo threads; a later scenario of that layout builds a new mesh anyway (topology._groups_alive)
    topology._MESHES.clear()
    process_groups.forget_subgroups()  # the same for the pipeline's tied-weight holder groups and the like
    _clear_dtensor_caches()
    gc.collect()  # the scenario's trainer, module and mesh hold the groups in reference cycles


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions and redistribution plans by mesh, and a mesh compares equal to an earlier
    one of the same shape and names whatever its groups: a later scenario's cache hit would hand back the destroyed
    groups of an earlier one's mesh ("Could not resolve the process group registered under the name ...")."""
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop, debug

    for clear in (
        getattr(debug, "_clear_sharding_prop_cache", None),
        # the collective cost model's per-mesh topology: it holds the mesh, and through it the scenario's groups,
        # whose gloo threads then stay alive (9 per 3D scenario and rank, which made later scenarios ~1.5x slower)
        getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None), "cache_clear",
                None),
        # the tensor-meta cache, an lru_cache on a method, not cleared by the debug helper above: it holds specs, and
        # through them meshes and groups, as the topology cache does
        getattr(getattr(getattr(_sharding_prop, "ShardingPropagator", None), "_propagate_tensor_meta_cached", None),
                "cache_clear", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ):
        if clear is not None:
            clear()


def main() -> None:
    spec, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    timings = _Timings(out_dir)  # the start-up lap: interpreter, torch and Lightning imports
    # the imports' objects (millions: torch, Lightning, transformers) live to the end: out of every collection, so
    # the one after each scenario (_free_scenario_groups) walks only what scenarios made
    gc.freeze()
    for scenario in spec:
        limit = scenario.get("timeout_s") or (_ERROR_SCENARIO_TIMEOUT_S if scenario.get("expect_error") else None)
        if limit:
            sys.stderr.flush()
            faulthandler.dump_traceback_later(limit, exit=True)
        groups = _process_groups()
        deepspeed = bool(scenario.get("deepspeed_source"))
        try:
            if deepspeed:  # a raw DeepSpeed engine writes a checkpoint for later scenarios
                from tests.deepspeed_source import record

                record(scenario, out_dir)
            elif scenario.get("runner") == "cli":  # a shipped YAML through the command's LightningCLI
                from tests.cli_runs import run as run_cli

                run_cli(scenario, out_dir)
            elif scenario.get("runner") == "resume":  # every kind of checkpoint resumed (tests/resume_runs.py)
                from tests.resume_runs import run as run_resume

                run_resume(scenario, out_dir)
            elif str(scenario.get("runner", "")).startswith("feature"):  # tests/features.py
                from tests.features import RUNNERS

                RUNNERS[scenario["runner"]](scenario, out_dir)
            else:
                run(scenario, out_dir)
        except Exception as error:
            if not scenario.get("expect_error"):
                if not dist.is_initialized() or dist.get_rank() == 0:
                    (out_dir / f"{scenario['name']}.error").write_text(traceback.format_exc())
                else:
                    sys.stderr.write(traceback.format_exc())
                raise  # a failure may leave ranks out of step: stop the group rather than risk a hang
            # configuration errors must be raised alike on every rank, before any collective: record each rank's
            rank = int(os.environ["RANK"])
            (out_dir / f"{scenario['name']}.rank{rank}.expected").write_text(f"{type(error).__name__}: {error}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        if not deepspeed:  # DeepSpeed keeps the groups it made in module globals, for its later engines
            # after the except clause: its traceback holds the scenario's frames, and through them its groups
            _free_scenario_groups(groups)
        timings.lap(scenario["name"])


if __name__ == "__main__":
    main()
