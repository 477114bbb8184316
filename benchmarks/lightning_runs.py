"""The Lightning side of the comparisons: ``HybridStrategy`` and the Lightning strategies that do the same job
(``"ddp"``, ``ModelParallelStrategy`` with FSDP2, ``ModelParallelStrategy`` with a hand-written TP plan, and on GPUs,
where Lightning allows them, ``FSDPStrategy`` and ``DeepSpeedStrategy``).

Every run trains ``examples.nanogpt.NanoGPT`` on the token batches of :func:`benchmarks.plain_torch.token_batches`
and returns the wall and CPU time of each training-loop iteration (end of one batch to the end of the next: data, hooks,
forward, backward, optimizer step), plus, for ``HybridStrategy``, what the theory tables need.

Example (inside a ``torchrun`` group of 2 CPU processes):
    >>> # times, extra = run_lightning({"kind": "hybrid", "strategy": {"zero_stage": 0}}, model, 16, steps=5)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.plain_torch import SEED, bench_device, hand_tensor_parallel, token_batches

# On GPUs every contestant runs bf16-mixed (the plain-torch references under the same autocast); on CPU fp32.
PRECISION = {"cuda": "bf16-mixed", "cpu": "32-true"}


class StepClock(L.Callback):
    """Wall and CPU clocks at the end of every training batch; optionally counts one step's communication
    (``meter_step``) and profiles the steps after the first (``profile``)."""

    def __init__(self, meter_step: Optional[int] = None, profile: bool = False) -> None:
        self.ends: list[tuple[float, float]] = []
        self.meter_step, self.profile = meter_step, profile
        self.communication: Optional[dict[tuple[str, str], tuple[int, int, float]]] = None
        self._meter: Any = None
        self._profiler: Optional[cProfile.Profile] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.meter_step is not None and idx == self.meter_step:
            from lightning_hybrid.monitoring.comm import CommunicationMeter

            self._meter = CommunicationMeter(trainer.strategy.device_mesh).__enter__()
        if self.profile and idx == 1:
            self._profiler = cProfile.Profile(time.process_time)  # CPU time: robust to other load
            self._profiler.enable()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: the step ends when the GPU is done
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.communication = {k: (s.calls, s.bytes, s.seconds) for k, s in self._meter.totals().items()}
            self._meter = None
        self.ends.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is not None:
            self._profiler.disable()

    def profile_rows(self, limit: int = 400) -> list[tuple[str, float, float, int]]:
        """(function, own seconds, cumulative seconds, calls) of the profiled steps, by cumulative time."""
        if self._profiler is None:
            return []
        stats = pstats.Stats(self._profiler, stream=io.StringIO())
        rows = []
        for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append((f"{_short(path)}:{line}({name})", own, cumulative, calls))
        return sorted(rows, key=lambda r: -r[2])[:limit]


def _short(path: str) -> str:
    # "lightning/" before "torch/": Lightning's files live under lightning/pytorch/, which contains "torch/"
    for marker in ("lightning_hybrid/", "lightning/", "torch/", "benchmarks/", "examples/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    return path


def _fsdp_module(model: dict[str, Any]) -> L.LightningModule:
    """The example with FSDP2 applied in ``configure_model`` as Lightning's ModelParallelStrategy docs show."""
    from examples.nanogpt import NanoGPT

    class FSDPNanoGPT(NanoGPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDPNanoGPT(**model)


def _tensor_parallel_module(model: dict[str, Any]) -> L.LightningModule:
    """The example with the hand-written TP plan in ``configure_model`` and the loss under ``loss_parallel``."""
    from torch.distributed.tensor.parallel import loss_parallel

    from examples.nanogpt import NanoGPT

    class TensorParallelNanoGPT(NanoGPT):
        def configure_model(self) -> None:
            hand_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            with loss_parallel():
                loss = self._loss(batch)
            self.log("train_loss", loss.full_tensor(), prog_bar=True, sync_dist=True)
            return loss

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            with loss_parallel():  # the vocabulary-parallel loss's backward needs the same context
                loss.backward()

    return TensorParallelNanoGPT(**model)


def _strategy(spec: dict[str, Any], world: int) -> Any:
    kind = spec["kind"]
    if kind == "hybrid":
        from lightning_hybrid import HybridStrategy

        return HybridStrategy(**spec.get("strategy", {}))
    if kind == "ddp":
        return "ddp"
    if kind == "lightning_fsdp":  # GPU only: Lightning refuses FSDPStrategy on CPU
        from lightning.pytorch.strategies import FSDPStrategy

        from examples.nanogpt import Block

        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    if kind == "lightning_deepspeed":  # GPU only: Lightning refuses DeepSpeedStrategy on CPU
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=spec["zero_stage"])
    if kind == "lightning_pipeline":  # a strategy that launches the processes and leaves the module as it is
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    if kind in ("model_parallel_fsdp", "model_parallel_tp"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = world if kind == "model_parallel_tp" else 1
        return ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp)
    raise ValueError(f"unknown Lightning contestant {kind!r}")


class _PipelineInLightning(L.LightningModule):
    """Lightning's loop around the plain pipeline (``benchmarks.plain_torch.PlainPipeline``), run the way the example
    runs (automatic optimization; one value logged on the progress bar: the last stage's loss, zero on the other
    stages, without a collective): the time it adds to the plain loop is the floor any Lightning strategy starts from
    for this module (loop, hooks, progress tracking, the optimizer closure, ``self.log``, the SIGTERM broadcast before
    every batch).

    The schedule runs forward and backward inside ``training_step``, and Lightning's closure zeroes the gradients
    between ``training_step`` and ``backward``: the step's gradients are held aside until ``backward``, as
    HybridStrategy's pipeline runner does.

    ``log=False`` leaves out the ``self.log`` (the ablation row that measures what Lightning's loop costs without it
    and without the per-batch SIGTERM broadcast, see :func:`run_lightning`)."""

    def __init__(self, model: dict[str, Any], schedule: str, microbatches: int, log: bool = True) -> None:
        super().__init__()
        self.model_config, self.schedule, self.microbatches, self.log_loss = model, schedule, microbatches, log
        self.pipeline: Any = None
        self._held: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def configure_model(self) -> None:
        from benchmarks.plain_torch import PlainPipeline

        if self.pipeline is None:
            self.pipeline = PlainPipeline(self.model_config, schedule=self.schedule, microbatches=self.microbatches)
            self.parts = torch.nn.ModuleList(self.pipeline.parts)

    def configure_optimizers(self) -> Any:
        return self.pipeline.optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline.step(*batch)
        self._held = [(p, p.grad) for p in self.pipeline.params if p.grad is not None]
        for p, _ in self._held:
            p.grad = None
        loss = loss if loss is not None else torch.zeros(())
        if self.log_loss:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        for p, grad in self._held:  # the schedule's backward already ran
            p.grad = grad
        self._held = []


def _module(spec: dict[str, Any], model: dict[str, Any]) -> L.LightningModule:
    from examples.nanogpt import NanoGPT

    L.seed_everything(SEED, verbose=False)
    if spec["kind"] == "lightning_pipeline":
        return _PipelineInLightning(model, spec["schedule"], spec["microbatches"], log=not spec.get("bare", False))
    if spec["kind"] == "model_parallel_fsdp":
        return _fsdp_module(model)
    if spec["kind"] == "model_parallel_tp":
        return _tensor_parallel_module(model)
    return NanoGPT(**model)


def data_parallel_size(spec: dict[str, Any], world: int) -> int:
    """Model replicas of a contestant (the DataLoader's batch is the global batch divided by this)."""
    if spec["kind"] == "hybrid":
        s = spec.get("strategy", {})
        return world // (s.get("tensor_parallel_size", 1) * s.get("pipeline_parallel_size", 1))
    return 1 if spec["kind"] in ("model_parallel_tp", "lightning_pipeline") else world


def run_lightning(
    spec: dict[str, Any],
    model: dict[str, Any],
    global_batch: int,
    *,
    steps: int,
    meter_step: Optional[int] = None,
    profile: bool = False,
) -> tuple[list[float], dict[str, Any]]:
    """Train ``steps`` batches with one Lightning contestant: (wall, CPU) seconds of the iterations (``steps - 1``
    of them: the first has no start) and extras."""
    world = dist.get_world_size()
    dp = data_parallel_size(spec, world)
    tokens = token_batches(model["vocab_size"], model["block_size"], global_batch, steps)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    clock = StepClock(meter_step, profile)
    device = bench_device().type
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=world,
        precision=PRECISION[device],
        strategy=_strategy(spec, world),
        callbacks=[clock],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = _module(spec, model)
    if spec.get("bare"):
        # the ablation row: Lightning's loop without its per-batch broadcast of rank 0's SIGTERM flag (a blocking
        # collective before every batch; the module does not log either), to measure what those two cost
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=global_batch // dp, drop_last=True))
    times = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock.ends, clock.ends[1:])]
    extra: dict[str, Any] = {"peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    strategy = trainer.strategy
    if spec["kind"] == "hybrid":
        extra["model_state_bytes"] = dict(getattr(strategy, "model_state_bytes", {}) or {})
        extra["local_numel"] = tensor_parallel_local_numel(module)
        timeline = strategy.pipeline_timeline
        extra["bubble"] = timeline.bubble_fraction if timeline is not None else None
        extra["stages"] = sorted(strategy._pipeline.stages) if strategy._pipeline is not None else [0]
        extra["num_stages"] = strategy._pipeline.split.num_stages if strategy._pipeline is not None else 1
    extra["communication"] = clock.communication
    extra["profile"] = clock.profile_rows()
    return times, extra


def tensor_parallel_local_numel(module: torch.nn.Module) -> int:
    """Parameters this rank holds after tensor and pipeline parallel, before ZeRO (what the ZeRO formula starts from):
    a parameter sharded over the data dimension (ZeRO-3) counts with its full data-parallel size."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in {id(p): p for p in module.parameters()}.values():
        numel = p.numel()
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for name, placement in zip(names, p.placements):
                if name == "tensor" and not placement.is_replicate():
                    numel //= p.device_mesh.size(names.index("tensor"))
        total += numel
    return total
