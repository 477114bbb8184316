"""Monitoring and health checks: the communication meter's exact byte counts, an offline W&B run read back from disk
(the monitor added by the strategy, no callback listed; also through the ``lightning-hybrid`` command),
``monitor=False``, the console line, alerts, replica checksums, the rank-to-device check, and torchmetrics over data
parallel only.

All multi-process scenarios run in ONE launched group of 4 CPU processes (this file is also the worker:
``python tests/fork_launch.py 4 tests.test_monitoring:_worker_main SPEC OUT``, or under ``torchrun``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.log_readers import read_wandb_run as _read_wandb_run

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
LOG_EVERY = 2
STEPS = 4

# ---------------------------------------------------------------------------------------------------------------------
# worker side (runs inside torchrun)


def _scenario_comm(out: Path) -> dict[str, Any]:
    """Known operations on a (data=2, tensor=2) mesh, with the bytes each must count."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lightning_hybrid.monitoring import CommunicationMeter

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    result: dict[str, Any] = {}
    # the meter replaces nothing: torch.distributed's functions, in both of torch's namespaces, stay the ones imported
    names = ["all_reduce", "broadcast", "isend", "irecv", "send", "recv", "batch_isend_irecv", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_to_all_single", "barrier", "all_gather_object"]  # fmt: skip
    namespaces = (dist, dist.distributed_c10d)
    originals = [[getattr(ns, n) for n in names] for ns in namespaces]
    with CommunicationMeter(mesh) as meter:
        dist.all_reduce(torch.ones(256), group=mesh.get_group("tensor"))  # c10d: 1024 bytes
        # DTensor's scatter of a tensor it distributes: each rank's 4x4 fp32 piece, 64 bytes
        x = distribute_tensor(torch.randn(8, 4), mesh["tensor"], [Shard(0)])
        x.full_tensor()  # DTensor functional all-gather: gathered 8x4 fp32 = 128 bytes
        partial = DTensor.from_local(torch.ones(6), mesh["tensor"], [Partial()])
        partial.redistribute(mesh["tensor"], [Replicate()]).to_local()  # functional all-reduce: 24 bytes
        result["a"] = meter.totals()
        with CommunicationMeter(mesh) as inner:  # two meters at once both count
            dist.broadcast(torch.zeros(10, dtype=torch.float64), src=0)  # world: 80 bytes
        result["inner"] = inner.totals()
        meter.reset()
        linear = torch.nn.Linear(4, 8, bias=False)
        fully_shard(linear, mesh=mesh["data"])  # ZeRO-3 over the data dimension
        linear(torch.randn(3, 4)).sum().backward()  # all-gather 8x4 fp32 = 128 bytes, reduce-scatter 128 bytes
        result["fsdp"] = meter.totals()
        meter.reset()
        peer = rank ^ 2  # the data-parallel peer
        ops = [dist.P2POp(dist.isend, torch.ones(10), peer), dist.P2POp(dist.irecv, torch.empty(10), peer)]
        for work in dist.batch_isend_irecv(ops if rank < 2 else ops[::-1]):
            work.wait()
        # the pipeline schedules' homogeneous path calls isend/irecv directly, on the pipeline group by group rank
        group = mesh.get_group("data")
        if rank < 2:
            work = dist.isend(torch.ones(5, dtype=torch.float16), group=group, group_dst=1)
        else:
            work = dist.irecv(torch.empty(5, dtype=torch.float16), group=group, group_src=0)
        result["work_is_torchs"] = type(work) is dist.Work  # what a call returns is torch's own, not a wrapper
        work.wait()
        result["p2p"] = meter.totals()
        result["untouched_inside"] = [[getattr(ns, n) for n in names] for ns in namespaces] == originals
    # after exit nothing is counted
    dist.all_reduce(torch.ones(1))
    result["after"] = meter.totals()
    result["untouched_after"] = [[getattr(ns, n) for n in names] for ns in namespaces] == originals
    return result


VAL_SAMPLES, VAL_BATCH = 32, 4


def _scenario_example_metric(out: Path) -> dict[str, Any]:
    """The nanoGPT example validates with torchmetrics' Perplexity under tp=2 x dp=2 (vocabulary-parallel logits)."""
    import lightning as L

    from lightning_hybrid import HybridStrategy
    from tests.harness import build_module, make_dataset, trainer_kwargs

    module = build_module("nanogpt")
    subset = torch.utils.data.Subset(make_dataset(), range(VAL_SAMPLES))
    loader = torch.utils.data.DataLoader(subset, batch_size=VAL_BATCH)
    kwargs = {**trainer_kwargs(1), "limit_val_batches": None}
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=HybridStrategy(tensor_parallel_size=2), **kwargs)
    trainer.validate(module, dataloaders=loader, verbose=False)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _scenario_trainer(out: Path, name: str, **options: Any) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.monitoring import HealthCheckError, HealthChecks, HybridMonitor
    from tests.harness import make_dataset, trainer_kwargs

    module = _module(options.get("module", "nanogpt"))
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=4, shuffle=True)
    callbacks: list[Any] = []
    monitor = None
    if options.get("monitor"):
        monitor = HybridMonitor(log_every_n_steps=LOG_EVERY, peak_flops=1e11, **options.get("monitor_kwargs", {}))
        callbacks.append(monitor)
    health = options.get("health")
    if health == "bad_device_map":

        class SameDevice(HealthChecks):
            def _local_facts(self, trainer: L.Trainer) -> dict[str, Any]:
                facts = super()._local_facts(trainer)
                rank = trainer.global_rank
                facts["device"] = "cuda:GPU-0000" if rank in (0, 1) else f"cuda:GPU-000{rank}"
                return facts

        callbacks.append(SameDevice())
    elif health == "perturb":
        callbacks.append(HealthChecks(replica_check_every_n_steps=2))
        callbacks.append(_Perturb())
    untouched = _Untouched()
    callbacks.append(untouched)
    kwargs = {**trainer_kwargs(STEPS), **options.get("trainer", {})}
    if options.get("wandb"):
        from lightning.pytorch.loggers import WandbLogger

        kwargs["logger"] = WandbLogger(project="lightning-hybrid-test", save_dir=str(out / name))
    if options.get("csv"):
        from lightning.pytorch.loggers import CSVLogger

        kwargs["logger"] = CSVLogger(save_dir=str(out / name), name="logs")
    strategy = HybridStrategy(**options["strategy"])
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, callbacks=callbacks, **kwargs)
    result: dict[str, Any] = {"error": None}
    if options.get("count_routing"):
        result["routed"] = _count_routing(module, trainer)
    try:
        trainer.fit(module, train_dataloaders=loader)
    except HealthCheckError as error:  # raised on every rank alike: nobody is left waiting in a collective
        result["error"] = str(error)
    if options.get("count_routing"):
        result["tensor_rank"] = strategy.device_mesh["tensor"].get_local_rank()
    if monitor is not None:
        result["alerts"] = monitor.alerts
        result["last_metrics"] = monitor.last_metrics
    if options.get("metrics"):
        result["metrics"] = {k: float(m.compute()) for k, m in module.tracked.items()}
        result["metric_groups"] = [
            m.process_group is strategy.device_mesh["data"].get_group() for m in module.tracked.values()
        ]
    if options.get("wandb") and dist.get_rank() == 0:
        import wandb

        wandb.finish()
    result["untouched"] = untouched.seen
    result["health_callbacks"] = sum(isinstance(c, HealthChecks) for c in trainer.callbacks)
    monitors = [c for c in trainer.callbacks if isinstance(c, HybridMonitor)]
    result["monitor_callbacks"] = len(monitors)
    result["monitor_is_users"] = monitor is not None and monitors == [monitor]
    if monitors:
        result["last_metrics"] = monitors[0].last_metrics
    return result


def _count_routing(module: Any, trainer: Any) -> dict[int, dict[str, list[int]]]:
    """What the router chose on this rank, seen apart from the strategy: a hook before each experts module (the
    dispatch runs inside it) counts the expert indices it is given, per optimizer step, once per forward."""
    from lightning_hybrid.expert_parallel import find_expert_modules

    routed: dict[int, dict[str, list[int]]] = {}
    experts, _ = find_expert_modules(module)

    def hook(name: str, num_experts: int) -> Any:
        def count(sub: Any, args: tuple) -> None:
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # not a recomputation
                step = routed.setdefault(trainer.global_step + 1, {})
                counts = torch.bincount(args[1].reshape(-1), minlength=num_experts).tolist()
                step[name] = [a + b for a, b in zip(step.get(name, [0] * num_experts), counts)]

        return count

    for e in experts:
        module.get_submodule(e.name).register_forward_pre_hook(hook(e.name, e.num_experts))
    return routed


C10D_NAMES = ["all_reduce", "broadcast", "reduce", "isend", "irecv", "send", "recv", "batch_isend_irecv", "barrier",
              "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
              "all_gather_object", "broadcast_object_list"]  # fmt: skip


def _c10d_functions() -> list[Any]:
    import torch.distributed as dist

    return [getattr(ns, n) for ns in (dist, dist.distributed_c10d) for n in C10D_NAMES]


class _Untouched:
    """In the middle of every optimizer step (the monitor's meter is active on its logging steps): whether torch's
    c10d functions are the ones imported before the fit, the class of each optimizer the trainer holds, and whether
    any experts module holds a forward of its own (expert parallel dispatches through hooks)."""

    def __new__(cls) -> Any:
        import lightning as L

        class Untouched(L.Callback):
            def __init__(self) -> None:
                self.originals = _c10d_functions()
                self.seen: list[tuple[bool, list[str], list[str]]] = []

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                from lightning_hybrid.expert_parallel import find_expert_modules

                classes = [f"{type(o).__module__}.{type(o).__qualname__}" for o in trainer.optimizers]
                experts = [e.name for e in find_expert_modules(pl_module)[0]]
                own = [n for n in experts if "forward" in pl_module.get_submodule(n).__dict__]
                self.seen.append((_c10d_functions() == self.originals, classes, own))

        return Untouched()


class _Perturb:
    """After step 1, data-parallel replica 1 nudges one weight: the replica check at step 2 must name it."""

    def __new__(cls) -> Any:
        import lightning as L

        class Perturb(L.Callback):
            def on_train_batch_end(
                self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                if trainer.global_step == 1 and trainer.strategy.device_mesh["data"].get_local_rank() == 1:
                    param = dict(pl_module.named_parameters())["model.h.1.mlp.c_proj.weight"]
                    local = param.to_local() if hasattr(param, "to_local") else param
                    with torch.no_grad():
                        local[0, 0] += 1e-3

        return Perturb()


def _module(kind: str) -> Any:
    from examples.nanogpt import NanoGPT
    from tests.harness import MODEL_DEFAULTS, build_module

    if kind in ("nanogpt", "hf-mixtral"):
        return build_module(kind)

    class Tracked(NanoGPT):
        """nanoGPT with torchmetrics that expose double counting (a sum), and a NaN loss at a chosen step."""

        def __init__(self, nan_at: int = -1, **kwargs: Any) -> None:
            import torchmetrics

            super().__init__(**kwargs)
            self.nan_at = nan_at
            self.tracked = torch.nn.ModuleDict(
                {"loss_sum": torchmetrics.SumMetric(), "loss_mean": torchmetrics.MeanMetric()}
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.tracked["loss_sum"].update(loss.detach() * batch[0].shape[0])
            self.tracked["loss_mean"].update(loss.detach(), weight=batch[0].shape[0])
            if self.global_step == self.nan_at:
                loss = loss * float("nan")
            return loss

    import lightning as L

    L.seed_everything(1234, verbose=False)
    # the NaN comes at the last step: the metrics were updated with that step's finite loss before it
    return Tracked(nan_at=STEPS - 1, **MODEL_DEFAULTS["nanogpt"])


SCENARIOS: dict[str, dict[str, Any]] = {
    "comm": {},
    # 3D minus one dimension so that 4 processes suffice: pipeline (2 stages) x data 2, logged to an offline W&B run;
    # no HybridMonitor listed: the strategy adds it because a logger is attached
    "wandb": {
        "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 2},
        "wandb": True,
        "trainer": {"log_every_n_steps": LOG_EVERY},
    },
    # tp=2 x dp=2 with torchmetrics in the module, and a NaN loss at the last step; the user lists a HybridMonitor
    # and attaches a logger: the strategy must not add a second monitor
    "metrics": {
        "strategy": {"tensor_parallel_size": 2},
        "module": "tracked",
        "metrics": True,
        "monitor": True,
        "csv": True,
    },
    # a logger, and the monitor turned off: Lightning's own metrics only
    "monitor_off": {"strategy": {"monitor": False}, "csv": True, "trainer": {"log_every_n_steps": 1}},
    "perturb": {"strategy": {"tensor_parallel_size": 2, "zero_stage": 0}, "health": "perturb"},
    "device_map": {"strategy": {"tensor_parallel_size": 2}, "health": "bad_device_map", "trainer": {"max_steps": 1}},
    "example_metric": {},
    # Mixtral's experts over the two data-parallel ranks, with tensor parallel (ZeRO-1), logged to an offline W&B
    # run: tokens per expert and layer (tensor peers route the same tokens: counted once), the all-to-all's share
    "experts": {
        "strategy": {"expert_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1},
        "module": "hf-mixtral",
        "wandb": True,
        "count_routing": True,
        "trainer": {"log_every_n_steps": LOG_EVERY},
    },
}


def _worker_main() -> None:
    import torch.distributed as dist

    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Lightning reuses it
    for name in spec:
        try:
            options = SCENARIOS[name]
            if name == "comm":
                result = _scenario_comm(out)
            elif name == "example_metric":
                result = _scenario_example_metric(out)
            else:
                result = _scenario_trainer(out, name, **options)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            if dist.get_rank() == 0:
                torch.save(gathered, out / f"{name}.pt")
        except Exception:
            (out / f"{name}.rank{os.environ.get('RANK')}.error").write_text(traceback.format_exc())
            raise


# ---------------------------------------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("monitoring")
    spec = out / "spec.json"
    spec.write_text(json.dumps(list(SCENARIOS)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("WANDB_MODE", None)  # no credentials here: the monitor must choose offline by itself
    env.pop("WANDB_API_KEY", None)
    env["NETRC"] = str(out / "no-netrc")
    # forked after one import (tests/fork_launch.py, as the shared launches); the command's own start is tested below
    cmd = [sys.executable, str(ROOT / "tests" / "fork_launch.py"), str(WORLD), "tests.test_monitoring:_worker_main",
           str(spec), str(out)]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=out, capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL
        )
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = f"TIMEOUT (a hang)\n{e.stdout}\n{e.stderr}"
    return {"out": out, "log": log}


def _result(group: dict[str, Any], name: str) -> list[dict[str, Any]]:
    path = group["out"] / f"{name}.pt"
    if not path.exists():
        errors = "\n".join(p.read_text() for p in sorted(group["out"].glob(f"{name}.rank*.error")))
        pytest.fail(f"scenario {name} did not finish:\n{errors or group['log'][-6000:]}")
    return torch.load(path, weights_only=False)


def test_communication_meter_counts_exact_bytes_per_dimension(group: dict[str, Any]) -> None:
    for rank, r in enumerate(_result(group, "comm")):
        a = {k: (v.calls, v.bytes) for k, v in r["a"].items()}
        assert a == {
            ("tensor", "all_reduce"): (2, 1024 + 24),
            ("tensor", "scatter"): (1, 64),
            ("tensor", "all_gather_into_tensor"): (1, 128),
        }, (rank, a)
        assert all(v.seconds > 0 for v in r["a"].values())
        assert {k: (v.calls, v.bytes) for k, v in r["inner"].items()} == {("world", "broadcast"): (1, 80)}
        fsdp = {k: (v.calls, v.bytes) for k, v in r["fsdp"].items()}
        # FSDP2's all_gather_single / reduce_scatter_single run c10d's tensor all-gather and reduce-scatter
        assert fsdp == {("data", "all_gather_into_tensor"): (1, 128), ("data", "reduce_scatter_tensor"): (1, 128)}, fsdp
        p2p = {k: (v.calls, v.bytes) for k, v in r["p2p"].items()}
        # one send and one receive of 40 bytes each (batch_isend_irecv), then 10 fp16 bytes sent by ranks 0-1
        expected = {("data", "send"): (2, 50), ("data", "recv"): (1, 40)}
        if rank >= 2:
            expected = {("data", "send"): (1, 40), ("data", "recv"): (2, 50)}
        assert p2p == expected, (rank, p2p)
        assert {k: (v.calls, v.bytes) for k, v in r["after"].items()} == p2p  # nothing counted after it exited
        assert r["work_is_torchs"] and r["untouched_inside"] and r["untouched_after"]


MONITOR_METRICS = [
    "trainer/global_step", "trainer/global_batch_index", "train/loss", "train/lr", "train/grad_norm",
    "train/loss_scale", "train/skipped_steps", "throughput/tokens_per_s", "throughput/samples_per_s",
    "throughput/step_time_s", "memory/peak_bytes_max", "memory/peak_bytes_min",
    "memory/model_state_bytes_max", "memory/model_state_bytes_min", "comm/share", "comm/share_tensor",
    "comm/share_pipeline", "comm/share_data", "comm/share_expert", "pipeline/bubble_fraction", "throughput/flops_per_s",
    "throughput/flops_per_s_per_device",
]  # fmt: skip
# (plus ``throughput/mfu`` where the device's peak is known: never on CPU by Lightning's table, so only where given;
# the achieved FLOP/s is logged without one)


def test_nothing_of_torch_is_replaced_during_a_fit(group: dict[str, Any]) -> None:
    """During fits with the communication meter on (tensor x data, pipeline x data, expert parallel), at every
    optimizer step: torch.distributed's functions are the ones imported before, each optimizer's class is the one
    ``configure_optimizers`` returned (ZeRO-1 wraps it by composition), and no experts module has a forward of its
    own."""
    for name in ("metrics", "wandb", "experts"):
        for rank, r in enumerate(_result(group, name)):
            assert len(r["untouched"]) == STEPS, (name, rank, r["untouched"])
            for same, classes, own in r["untouched"]:
                assert same, f"{name} rank {rank}: a c10d function was replaced during the fit"
                assert classes == ["torch.optim.adamw.AdamW"], (name, rank, classes)
                assert own == [], (name, rank, own)
            if name == "experts":
                assert r["routed"], "the experts scenario ran no experts module"


def test_offline_wandb_run_holds_every_metric_once_per_logging_step_and_the_layout(group: dict[str, Any]) -> None:
    results = _result(group, "wandb")
    assert all(r["monitor_callbacks"] == 1 for r in results)  # added by the strategy: no callback was listed
    runs = list((group["out"] / "wandb").rglob("offline-run-*"))
    assert len(runs) == 1, runs  # one run (rank 0), offline without credentials, never a prompt
    run = _read_wandb_run(runs[0])
    rows = [row for row in run["history"] if "train/loss" in row]
    assert all("throughput/mfu" not in row for row in rows)  # CPU: no peak FLOP/s known, no MFU (and a warning)
    assert [row["trainer/global_step"] for row in rows] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for row in rows:
        missing = [m for m in MONITOR_METRICS if m not in row]
        assert not missing, missing
        assert all(math.isfinite(row[m]) for m in MONITOR_METRICS), row
        assert row["pipeline/bubble_fraction"] > 0 and row["comm/share_pipeline"] > 0 and row["comm/share_data"] > 0
        assert row["comm/share_tensor"] == 0  # tp=1 here
        assert row["memory/peak_bytes_max"] >= row["memory/peak_bytes_min"] > 0
        assert row["throughput/tokens_per_s"] == pytest.approx(row["throughput/samples_per_s"] * 16)
        # achieved FLOP/s without a known peak: FLOPs per token x tokens/s, and per rank
        flops = row["throughput/tokens_per_s"] * _flops_per_token_of_tracked()
        assert row["throughput/flops_per_s"] == pytest.approx(flops, rel=1e-6) and flops > 0
        assert row["throughput/flops_per_s_per_device"] == pytest.approx(flops / 4, rel=1e-6)
    layout = run["config"]["lightning_hybrid"]
    assert layout["pipeline_parallel_size"] == 2 and layout["data_parallel_size"] == 2
    assert layout["tensor_parallel_size"] == 1 and layout["zero_stage"] == 1
    assert layout["world_size"] == 4 and layout["global_batch_size"] == 8 and layout["precision"] == "32-true"
    assert layout["versions"]["torch"] == torch.__version__
    assert layout["num_microbatches"] == 2 and layout["pipeline_schedule"] == "1f1b"
    # with a WandbLogger, alerts go to wandb.alert (into the run): one per logging step whose share was above 30%
    assert run["alerts"] == ["Communication share" for row in rows if row["comm/share"] > 0.30]
    # the loss logged is the data-parallel mean that every rank computed alike
    assert {r["last_metrics"]["train/loss"] for r in results} == {rows[-1]["train/loss"]}


def test_tokens_per_expert_and_the_all_to_all_share_reach_wandb(group: dict[str, Any]) -> None:
    """Each MoE layer's tokens per expert on a logging step are what the router chose on every data-parallel rank
    that step, summed (counted apart from the strategy, before the dispatch): every token's top-k once."""
    results = _result(group, "experts")
    runs = list((group["out"] / "experts").rglob("offline-run-*"))
    assert len(runs) == 1, runs
    rows = [row for row in _read_wandb_run(runs[0])["history"] if "train/loss" in row]
    assert [row["trainer/global_step"] for row in rows] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    layers = sorted(results[0]["routed"][LOG_EVERY])
    assert len(layers) == 2, layers  # the tiny Mixtral's two MoE layers
    replicas = [r for r in results if r["tensor_rank"] == 0]
    assert len(replicas) == 2
    for row in rows:
        step = int(row["trainer/global_step"])
        for layer in layers:
            # tensor peers saw the same tokens, and route them alike
            assert [r["routed"][step][layer] for r in results if r["tensor_rank"] == 1] == [
                r["routed"][step][layer] for r in replicas
            ]
            routed = [sum(col) for col in zip(*(r["routed"][step][layer] for r in replicas))]
            logged = [row[f"experts/{layer}/tokens_{i}"] for i in range(len(routed))]
            assert logged == routed, (step, layer, logged, routed)
            assert sum(logged) == len(replicas) * 4 * 16 * 2  # replicas x samples x tokens x top-2
            assert row[f"experts/{layer}/load_imbalance"] == pytest.approx(max(routed) * len(routed) / sum(routed))
        assert row["experts/load_imbalance_max"] >= 1
        assert row["comm/share_expert"] > 0 and row["comm/share_data"] > 0 and row["comm/share_tensor"] > 0
    assert any("experts max/mean" in line for line in group["log"].splitlines())


def test_console_line_every_n_steps(group: dict[str, Any]) -> None:
    _result(group, "wandb")
    lines = [line for line in group["log"].splitlines() if " | loss " in line and line.lstrip().startswith("step ")]
    lines = [line for line in lines if "experts max/mean" not in line]  # the experts scenario's own
    wandb_lines = [line for line in lines if "bubble" in line and "comm" in line]
    steps = [int(line.split()[1]) for line in wandb_lines]
    # the wandb and metrics scenarios both log at steps 2 and 4, and print once (rank 0) each time
    assert steps.count(LOG_EVERY) == 2 and steps.count(STEPS) == 2 and len(steps) == 4, lines
    for field in ("batch", "loss", "lr", "tok/s", "samples/s", "mem", "GiB", "comm", "tp", "pp", "dp", "bubble"):
        assert field in wandb_lines[0], (field, wandb_lines[0])
    assert sum(" | mfu " in line for line in wandb_lines) == 2  # the metrics scenario's monitor was given a peak


def test_torchmetrics_sync_over_data_parallel_only_matches_single_process(group: dict[str, Any]) -> None:
    import lightning as L

    from tests.harness import make_dataset, reference_loader, trainer_kwargs

    results = _result(group, "metrics")
    module = _module("tracked")
    trainer = L.Trainer(accelerator="cpu", devices=1, **trainer_kwargs(STEPS))
    trainer.fit(module, train_dataloaders=reference_loader(make_dataset(), data_parallel_size=2, batch_size=4))
    expected = {k: float(m.compute()) for k, m in module.tracked.items()}
    for r in results:
        assert all(r["metric_groups"])
        for key, value in expected.items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-5), (key, r["metrics"][key], value)
    assert results[0]["last_metrics"]["comm/share_tensor"] > 0  # tensor parallel collectives were measured


def test_a_listed_monitor_is_not_added_twice_and_gets_mfu_from_a_given_peak(group: dict[str, Any]) -> None:
    results = _result(group, "metrics")  # HybridMonitor in the callbacks and a CSV logger attached
    assert all(r["monitor_callbacks"] == 1 and r["monitor_is_users"] for r in results)
    metrics = results[0]["last_metrics"]
    # MFU = FLOPs per token x tokens/s / (devices x peak), computed by Lightning's Throughput with a replica as device
    expected = metrics["throughput/tokens_per_s"] * _flops_per_token_of_tracked() / (WORLD * 1e11)
    assert metrics["throughput/mfu"] == pytest.approx(expected, rel=1e-9) and metrics["throughput/mfu"] > 0
    assert metrics["throughput/flops_per_s_per_device"] == pytest.approx(expected * 1e11, rel=1e-9)
    header = next((group["out"] / "metrics").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert "train/loss" in header and "throughput/mfu" in header, header


def _flops_per_token_of_tracked() -> float:
    from lightning_hybrid.monitoring.flops import transformer_flops_per_token
    from tests.harness import MODEL_DEFAULTS, SEQ_LEN

    hp = MODEL_DEFAULTS["nanogpt"]
    parameters = sum(p.numel() for p in _module("tracked").parameters())  # the unsplit model
    return transformer_flops_per_token(parameters, hp["n_layer"], hp["n_embd"], SEQ_LEN)


def test_monitor_false_logs_no_3d_metrics(group: dict[str, Any]) -> None:
    results = _result(group, "monitor_off")
    assert all(r["monitor_callbacks"] == 0 for r in results)
    header = next((group["out"] / "monitor_off").rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert "train_loss" in header, header  # the module's own metric was logged: the logger worked
    assert not [c for c in header if c.split("/")[0] in ("train", "throughput", "memory", "comm", "pipeline")], header


def test_example_perplexity_under_tensor_and_data_parallel_matches_single_process(group: dict[str, Any]) -> None:
    import lightning as L

    from tests.harness import build_module, make_dataset, trainer_kwargs

    # the same batches in the same order: step s averages replica 0's and replica 1's s-th batch (Lightning's
    # unshuffled DistributedSampler gives replica r the samples r, r + 2, ...), and the epoch averages the steps
    per_replica = [list(range(VAL_SAMPLES))[r::2] for r in range(2)]
    batches = [per_replica[r][i : i + VAL_BATCH] for i in range(0, VAL_SAMPLES // 2, VAL_BATCH) for r in range(2)]
    subset = torch.utils.data.Subset(make_dataset(), range(VAL_SAMPLES))
    module = build_module("nanogpt")
    trainer = L.Trainer(accelerator="cpu", devices=1, **{**trainer_kwargs(1), "limit_val_batches": None})
    trainer.validate(module, dataloaders=torch.utils.data.DataLoader(subset, batch_sampler=batches), verbose=False)
    for r in _result(group, "example_metric"):
        for key in ("val_perplexity", "val_loss"):
            assert r[key] == pytest.approx(float(trainer.callback_metrics[key]), rel=1e-5), (key, r)


def test_nan_loss_raises_the_alert(group: dict[str, Any]) -> None:
    results = _result(group, "metrics")  # its module returns a NaN loss at the last step
    alerts = results[0]["alerts"]
    assert [(step, title) for step, title, _ in alerts if title == "Non-finite loss"] == [(STEPS, "Non-finite loss")]
    assert "HybridMonitor alert: Non-finite loss" in group["log"]  # no W&B logger: a warning


def test_perturbed_replica_is_named_with_the_step(group: dict[str, Any]) -> None:
    results = _result(group, "perturb")
    for r in results:  # every rank stopped with the same report
        assert r["error"] is not None and "model.h.1.mlp.c_proj.weight" in r["error"] and "step 2" in r["error"]
        assert "model.h.0" not in r["error"]


def test_two_ranks_on_one_device_is_an_error_naming_them(group: dict[str, Any]) -> None:
    results = _result(group, "device_map")
    for r in results:
        assert r["error"] is not None and "Ranks 0 and 1 both use device cuda:GPU-0000" in r["error"], r["error"]
    assert results[0]["health_callbacks"] == 1  # the strategy did not add a second one


def test_health_checks_are_added_by_default_and_can_be_turned_off(group: dict[str, Any]) -> None:
    from types import SimpleNamespace

    from lightning_hybrid.monitoring import HealthChecks
    from lightning_hybrid.monitoring.health import add_monitoring_defaults

    # the wandb scenario passed no HealthChecks: the strategy added one
    assert all(r["health_callbacks"] == 1 for r in _result(group, "wandb"))
    # what HybridStrategy(health_checks=...) does with each value
    off = SimpleNamespace(loggers=[], callbacks=[])
    add_monitoring_defaults(off, False)
    assert off.callbacks == []
    mine = HealthChecks(replica_check_every_n_steps=5)
    chosen = SimpleNamespace(loggers=[], callbacks=[])
    add_monitoring_defaults(chosen, mine)
    add_monitoring_defaults(chosen, True)  # Lightning sets up again for validate/test: never a second one
    assert chosen.callbacks == [mine]


def test_monitor_is_added_with_a_logger_unless_off_or_listed() -> None:
    from types import SimpleNamespace

    from lightning_hybrid.monitoring import HybridMonitor
    from lightning_hybrid.monitoring.health import add_monitoring_defaults

    def monitors(loggers: list[Any], monitor: Any, callbacks: Any = ()) -> list[Any]:
        trainer = SimpleNamespace(loggers=loggers, callbacks=list(callbacks))
        add_monitoring_defaults(trainer, False, monitor)
        add_monitoring_defaults(trainer, False, monitor)  # set up again (validate/test): never a second one
        return [c for c in trainer.callbacks if isinstance(c, HybridMonitor)]

    logger = object()
    assert [type(m) for m in monitors([logger], True)] == [HybridMonitor]  # the default, with a logger
    assert monitors([], True) == []  # no logger: nothing to log to
    assert monitors([logger], False) == []
    mine = HybridMonitor(log_every_n_steps=7)
    assert monitors([logger], mine) == [mine] and monitors([], mine) == [mine]  # an instance is always added
    listed = HybridMonitor()
    assert monitors([logger], True, [listed]) == [listed]  # the user's own, not a second one
    assert monitors([logger], mine, [listed]) == [listed]


def test_strategy_monitor_argument_is_checked() -> None:
    from lightning_hybrid import HybridConfigError, HybridStrategy

    with pytest.raises(HybridConfigError, match=r"`monitor='yes'`: pass True .* False, or a .*HybridMonitor"):
        HybridStrategy(monitor="yes")


def _fake_trainer(step: int = 0, skipped: int = 0) -> Any:
    from types import SimpleNamespace

    plugin = SimpleNamespace(skipped_steps=skipped)
    return SimpleNamespace(global_step=step, strategy=SimpleNamespace(precision_plugin=plugin), is_global_zero=True,
                           loggers=[])  # fmt: skip


def test_loss_spike_alert_above_factor_times_running_mean() -> None:
    from lightning_hybrid.monitoring import HybridMonitor

    seen: list[str] = []
    monitor = HybridMonitor(loss_spike_factor=3.0, loss_spike_window=20, alert_fn=lambda title, text: seen.append(text))
    trainer = _fake_trainer()
    for step, loss in enumerate([1.0, 9.0, 2.0, 2.0, 2.0], start=1):  # under 5 losses seen: no mean to judge by yet
        trainer.global_step = step
        monitor._check_step(trainer, loss)
    assert monitor.alerts == []
    trainer.global_step = 6
    monitor._check_step(trainer, 3.0 * 3.2 - 0.01)  # mean of the 5 is 3.2: just under 3x
    assert monitor.alerts == []
    for _ in range(20):  # a window of 20 forgets the early 9.0: the running mean settles near 2
        trainer.global_step += 1
        monitor._check_step(trainer, 2.0)
    trainer.global_step += 1
    with pytest.warns(UserWarning, match="HybridMonitor alert: Loss spike"):  # no W&B logger: a warning
        monitor._check_step(trainer, 6.6)
    assert [(step, title) for step, title, _ in monitor.alerts] == [(trainer.global_step, "Loss spike")]
    assert "6.6 at step 27 is 3.3x its running mean 2 over the last 20 steps (alert above 3.0x)" in seen[0], seen


def test_skipped_steps_alert_counts_skips_within_the_window() -> None:
    from lightning_hybrid.monitoring import HybridMonitor

    monitor = HybridMonitor(loss_spike_window=10, skipped_steps_alert=3)
    trainer = _fake_trainer()
    skipped_at = {2, 9, 15}  # never 3 within 10 steps: no alert
    for step in range(1, 21):
        trainer.global_step = step
        trainer.strategy.precision_plugin.skipped_steps += step in skipped_at
        monitor._check_step(trainer, 1.0)
    assert monitor.alerts == []
    for step in range(21, 29):  # skips at 26, 27 and 28: the third within the window alerts, once
        trainer.global_step = step
        trainer.strategy.precision_plugin.skipped_steps += step >= 26
        with pytest.warns(UserWarning, match="Skipped steps") if step == 28 else contextlib.nullcontext():
            monitor._check_step(trainer, 1.0)
    assert [(step, title) for step, title, _ in monitor.alerts] == [(28, "Skipped steps")]
    assert monitor.alerts[0][2].startswith(
        "3 of the last 10 optimizer steps were skipped for gradient overflow (step 28,"
    )
    trainer.global_step, trainer.strategy.precision_plugin.skipped_steps = 29, 7  # counting restarts after an alert
    monitor._check_step(trainer, 1.0)
    assert len(monitor.alerts) == 1


def test_clock_skew_between_hosts_warns_above_the_threshold() -> None:
    from lightning_hybrid.monitoring import HealthChecks

    checks = HealthChecks(clock_skew_seconds=2.0)
    close = [{"host": "a", "time": 100.0}, {"host": "a", "time": 103.0}, {"host": "b", "time": 101.9}]
    checks._check_clocks(close)  # within one host the clock is one clock; across hosts 1.9 s apart: fine
    assert checks.reports == []
    far = [{"host": "a", "time": 100.0}, {"host": "b", "time": 100.5}, {"host": "c", "time": 97.5}]
    with pytest.warns(UserWarning, match=r"The clock of host c is -2.50 s off host a \(threshold 2.0 s\)"):
        checks._check_clocks(far)
    assert len(checks.reports) == 1 and "synchronize the nodes' clocks" in checks.reports[0]


_USER_YAML = """
seed_everything: 1234
trainer:
  accelerator: cpu
  devices: 2
  precision: 16-mixed
  max_steps: 4
  log_every_n_steps: 2
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  logger:
    class_path: lightning.pytorch.loggers.WandbLogger
    init_args: {project: my-project, offline: true, save_dir: SAVE_DIR}
  strategy:
    class_path: lightning_hybrid.HybridStrategy
    init_args: {pipeline_parallel_size: 2, num_microbatches: 2}
model:
  class_path: examples.nanogpt.NanoGPT
  init_args: {vocab_size: 128, block_size: 16, n_layer: 2, n_head: 2, n_embd: 16}
data:
  class_path: examples.data.CharDataModule
  init_args: {block_size: 16, batch_size: 4, max_chars: 20000}
"""


@pytest.mark.timeout(400)
def test_command_with_a_users_wandb_config_logs_the_3d_metrics_without_a_callback(tmp_path: Path) -> None:
    """A user's YAML as the issue had it: WandbLogger and HybridStrategy, no HybridMonitor listed."""

    from tests.conftest import assert_clean_exit, console_script

    config = tmp_path / "my.yaml"
    config.write_text(_USER_YAML.replace("SAVE_DIR", str(tmp_path)))
    proc = console_script("fit", "--config", str(config), timeout=360)
    log = proc.stdout + proc.stderr
    assert_clean_exit(proc)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, (runs, log[-4000:])
    run = _read_wandb_run(runs[0])
    rows = [row for row in run["history"] if "train/loss" in row]
    assert [row["trainer/global_step"] for row in rows] == [2, 4], (run["history"], log[-4000:])
    for row in rows:
        assert not [m for m in MONITOR_METRICS if m not in row], row
        assert all(math.isfinite(row[m]) for m in MONITOR_METRICS), row
        assert row["pipeline/bubble_fraction"] > 0 and row["comm/share_pipeline"] > 0
    layout = run["config"]["lightning_hybrid"]
    assert (layout["pipeline_parallel_size"], layout["data_parallel_size"], layout["world_size"]) == (2, 1, 2)
    assert layout["precision"] == "bf16-mixed"  # Lightning's CPU fallback for 16-mixed
    assert "train_loss" in {key for row in run["history"] for key in row}  # and the module's own metric


# ---------------------------------------------------------------------------------------------------------------------
# single process


def test_rank_device_map_and_replica_mismatch_helpers() -> None:
    from lightning_hybrid.monitoring.health import HealthCheckError, check_rank_device_map, find_replica_mismatches

    check_rank_device_map([("a", "cpu"), ("a", "cpu")])  # CPU ranks share cores by design
    check_rank_device_map([("a", "cuda:GPU-1"), ("b", "cuda:GPU-1")])  # same id on two hosts: two devices
    with pytest.raises(HealthCheckError, match="Ranks 1 and 3 both use device cuda:GPU-7 on host a"):
        check_rank_device_map([("a", "cuda:GPU-0"), ("a", "cuda:GPU-7"), ("a", "cuda:GPU-2"), ("a", "cuda:GPU-7")])
    assert find_replica_mismatches(["w", "b"], torch.tensor([[5, 6], [5, 6], [5, 7]])) == ["b"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, r"`HybridMonitor\(log_every_n_steps=0\)`: pass a positive integer"),
        ({"log_every_n_steps": 2.5}, r"`HybridMonitor\(log_every_n_steps=2.5\)`: pass a positive integer"),
        ({"flops_per_token": -1.0}, r"`HybridMonitor\(flops_per_token=-1.0\)`: pass a positive number"),
        ({"peak_flops": 0}, r"`HybridMonitor\(peak_flops=0\)`: pass a positive number .* e.g. 989e12"),
        ({"communication_alert": 0}, r"`HybridMonitor\(communication_alert=0\)`: pass the share .* e.g. 0.3"),
        ({"loss_spike_factor": 0.5}, r"`HybridMonitor\(loss_spike_factor=0.5\)`: pass a number above 1"),
        ({"loss_spike_window": 0}, r"`HybridMonitor\(loss_spike_window=0\)`: pass a positive integer"),
        ({"skipped_steps_alert": -1}, r"`HybridMonitor\(skipped_steps_alert=-1\)`: pass a non-negative integer"),
        ({"skipped_steps_alert": 30}, r"`HybridMonitor\(skipped_steps_alert=30\)`: it can never fire: .*\(20\)"),
    ],
)
def test_bad_monitor_arguments_name_the_parameter_the_value_and_the_fix(kwargs: dict[str, Any], match: str) -> None:
    from lightning_hybrid import HybridConfigError
    from lightning_hybrid.monitoring import HybridMonitor

    with pytest.raises(HybridConfigError, match=match):
        HybridMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"on_mismatch": "ignore"}, r"`HealthChecks\(on_mismatch='ignore'\)`: pass 'raise' .* or 'warn'"),
        ({"replica_check_every_n_steps": -5}, r"`HealthChecks\(replica_check_every_n_steps=-5\)`: pass a non-neg"),
        ({"replica_check_every_n_steps": True}, r"`HealthChecks\(replica_check_every_n_steps=True\)`: pass a"),
        ({"clock_skew_seconds": -1}, r"`HealthChecks\(clock_skew_seconds=-1\)`: pass a non-negative number"),
    ],
)
def test_bad_health_check_arguments_name_the_parameter_the_value_and_the_fix(
    kwargs: dict[str, Any], match: str
) -> None:
    from lightning_hybrid import HybridConfigError
    from lightning_hybrid.monitoring import HealthChecks

    with pytest.raises(HybridConfigError, match=match):
        HealthChecks(**kwargs)


def test_offline_wandb_without_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lightning_hybrid.monitoring import use_offline_wandb_without_credentials

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert use_offline_wandb_without_credentials([]) is False  # no WandbLogger among the loggers: nothing to do
    assert use_offline_wandb_without_credentials() is True and os.environ["WANDB_MODE"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert use_offline_wandb_without_credentials() is False and os.environ["WANDB_MODE"] == "online"


if __name__ == "__main__":
    _worker_main()


def test_peak_flops_of_an_h200_that_lightnings_table_does_not_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning 2.6 gives no peak for a GPU named "NVIDIA H200", so MFU would be missing on H200 machines: the
    monitor takes the H100 SXM's dense figures (the same compute), and still defers to Lightning where it knows."""
    import lightning.fabric.utilities.throughput as throughput

    from lightning_hybrid.monitoring.flops import device_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(throughput, "get_available_flops", lambda device, dtype: None)
    cuda = torch.device("cuda", 0)
    assert device_peak_flops(cuda, torch.bfloat16) == 989.4e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak_flops(cuda, torch.float32) == 494.7e12  # TF32
    monkeypatch.setattr(throughput, "get_available_flops", lambda device, dtype: 1.0e15)
    assert device_peak_flops(cuda, torch.bfloat16) == 1.0e15


def test_step_flops_of_a_module_updating_torchmetrics_in_its_step_are_measured() -> None:
    """A module that updates and logs torchmetrics objects in ``training_step`` (found by an outside trial: its meta
    copy's metric states stayed on the CPU and the measurement fell back to 6N): the copy's metrics are stand-ins,
    and the count equals ``measure_flops`` of the step on one device; the module's own metrics are untouched."""
    import lightning as L
    import torchmetrics
    from lightning.fabric.utilities.throughput import measure_flops
    from torch import nn

    from lightning_hybrid.monitoring.flops import measure_training_flops, unsplit_meta_copy

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
            self.scores = torchmetrics.MetricCollection({"mean": torchmetrics.MeanMetric()})

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.accuracy(logits, y)
            self.scores.update(loss.detach())
            self.log("acc", self.accuracy)
            return loss

    batch = (torch.randn(4, 6), torch.tensor([0, 1, 2, 1]))
    module = Classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        measured = measure_training_flops(unsplit_meta_copy(module), batch)
    assert isinstance(module.accuracy, torchmetrics.Metric) and int(module.accuracy.tp.sum()) == 0
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    expected = measure_flops(module, lambda: module.training_step(batch, 0), loss_fn=lambda loss: loss)
    assert measured == expected > 0


def test_step_flops_measured_on_a_meta_copy_taken_before_configure_model_builds_the_layers() -> None:
    """The monitor's copy is taken before the strategy's set-up, so a module built in ``configure_model`` has no
    layers yet: measuring builds them on meta tensors and counts what ``measure_flops`` counts on one device; a step
    that reads a value cannot run on meta tensors and gives None (the monitor then falls back to 6N), with a
    warning."""
    import lightning as L
    from lightning.fabric.utilities.throughput import measure_flops
    from torch import nn

    from lightning_hybrid.monitoring.flops import measure_training_flops, unsplit_meta_copy

    class Built(L.LightningModule):
        def __init__(self, read_value: bool = False) -> None:
            super().__init__()
            self.net: Any = None
            self.read_value = read_value

        def configure_model(self) -> None:
            if self.net is None:
                self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss.item() if self.read_value else loss)
            return {"loss": loss}

    batch = (torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    module = Built()
    copy = unsplit_meta_copy(module)
    measured = measure_training_flops(copy, batch)
    assert module.net is None and copy is not None and copy.net is not None  # the original is left as it was
    module.configure_model()
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    expected = measure_flops(module, lambda: module.training_step(batch, 0)["loss"], loss_fn=lambda loss: loss)
    assert measured == expected > 0
    with pytest.warns(UserWarning, match="could not be measured on meta tensors"):
        assert measure_training_flops(unsplit_meta_copy(Built(read_value=True)), batch) is None
