"""HybridStrategy: the Lightning glue that composes the mesh, tensor parallel, the pipeline and ZeRO.

The logic lives in the per-concern modules (docs/architecture.md): the arguments' checks in ``config.py``, processes
and mesh in ``topology.py``, model surgery in ``parallelize.py``, the order of a training step in
``optimizer_step.py`` (the step spine), checkpoint I/O in ``checkpoint/``; this class only decides *when* each runs in
Lightning's loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_hybrid._lightning_compat as compat
import lightning_hybrid.topology as topology
from lightning_hybrid._hooks import attribute_replaced
from lightning_hybrid.checkpoint import ShardedCheckpointWriter
from lightning_hybrid.checkpoint.pretrained import LoadReport, load_pretrained_weights
from lightning_hybrid.checkpoint.strategy_io import StrategyCheckpoints
from lightning_hybrid.config import CheckpointOptions, PipelineOptions, TensorParallelOptions, ZeroOptions
from lightning_hybrid.construction.deferred import DeferredConstruction
from lightning_hybrid.data import sequence_part, skip_finished_batches
from lightning_hybrid.layout import ParallelLayout, StrategyOptions
from lightning_hybrid.module_step import check_before_fit, step_hook
from lightning_hybrid.monitoring.callback import HybridMonitor
from lightning_hybrid.monitoring.health import add_monitoring_defaults, check_monitor
from lightning_hybrid.monitoring.metrics import sync_metrics_over
from lightning_hybrid.monitoring.summary import summarize_whole_model
from lightning_hybrid.optimizer_step import OptimizerStep
from lightning_hybrid.parallelize import ModelOptions, Parallelized, parallelize
from lightning_hybrid.pipeline import PipelineRunner
from lightning_hybrid.planning.auto import resolve_layout
from lightning_hybrid.precision import HybridPrecision, check_supported
from lightning_hybrid.sharding.gradient_step import GradientStep
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer
from lightning_hybrid.watchdog import DEFAULT_TIMEOUT, resolve_timeout

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HybridStrategy"]

# the constructor's arguments that StrategyOptions.from_arguments checks (all but timeout and track_gradient_norm)
_OPTION_ARGUMENTS = frozenset(inspect.signature(StrategyOptions.from_arguments).parameters)


class HybridStrategy(ParallelStrategy):
    """Train any LightningModule in 3D parallel: tensor x pipeline x data parallel with ZeRO sharding.

    Each option is given flat (``pipeline_schedule="gpipe"``, as LightningCLI/YAML give them) or in its typed section
    (``pipeline=PipelineOptions(schedule="gpipe")``; the four sections are the last arguments below, documented field
    by field in ``lightning_hybrid.config``). A field of one word takes its section's name in front in the flat form
    (``plan`` <-> ``tensor_parallel_plan``); a longer one is the flat name itself (``num_microbatches``). The sizes and
    ``sequence_parallel`` are flat only. Both forms are checked once (``StrategyOptions.from_arguments``), raising
    :class:`~lightning_hybrid.HybridConfigError` alike on every rank, also for an option given both ways differently
    (a flat argument at its default counts as not given).

    Arguments:
        tensor_parallel_size: ranks that split each layer (DTensor). Consecutive ranks, so keep it within a node.
        pipeline_parallel_size: ranks that split the stack of blocks into stages (slowest mesh dimension).
        data_parallel_size: model replicas; ``"auto"`` is ``world_size // (tensor x pipeline)``.
        zero_stage: 0 replicate, 1 shard optimizer state, 2 also gradients, 3 also parameters (FSDP2).
        tensor_parallel_plan: ``"auto"`` (find the plan; Hugging Face models use the plan they declare), or a dict
            ``{module-name pattern: "colwise" | "rowwise" | ParallelStyle}``. If ``configure_model`` already
            parallelized the model with ``self.device_mesh["tensor"]``, the plan is not applied.
        sequence_parallel: shard norm/dropout activations along the sequence (Megatron-SP); needs tensor parallel.
        activation_checkpointing: ``True``/``"full"``: recompute each block in backward from its input; ``"selective"``:
            keep matmul, attention and collective outputs, recompute the rest (``SelectivePolicy``).
        activation_checkpointing_every: checkpoint every N-th block only (1: all of them).
        vocab_parallel_loss: keep the logits split over the vocabulary: a cross-entropy never gathers them, any
            other use gathers them once.
        transformer_blocks: name of the repeated block list when it cannot be found automatically.
        num_microbatches: micro-batches per optimizer step under pipeline parallel (default: the pipeline size);
            must divide the DataLoader's batch size.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"`` or
            ``"zbv_zero_bubble"`` (torch's ``pipelining`` schedules).
        virtual_pipeline_size: stages per rank for the interleaved and zero-bubble schedules.
        pipeline_partition: ``"uniform"``, ``"parameters"``, ``"profile"`` or block counts per stage.
        pipeline_network: name of the module ``training_step`` calls, if not the one owning the block list.
        verify_pipeline: compare the first batch's pipelined loss and gradient norm with an unsplit forward and
            refuse a mismatch: ``"auto"`` (fp32 models of at most 100M parameters), True or False (docs/pipeline.md).
        verify_tensor_parallel: the same comparison for tensor parallel without a pipeline: ``"auto"``, True or False
            (not under context parallel, whose own probe of the loss always runs: docs/context-parallel.md).
        zero3_gradient_sync: ZeRO-3 under pipeline parallel: reduce-scatter ``"per_step"`` or ``"per_microbatch"``.
        overlap_grad_reduce: reduce gradients in buckets during backward (ZeRO-0/2 without pipeline parallel).
        bucket_cap_mb: size of those buckets in MiB (DDP's ``bucket_cap_mb``).
        track_gradient_norm: take the global gradient norm (before clipping) every step into
            ``strategy.last_gradient_norm``; :class:`~lightning_hybrid.HybridMonitor` has it taken on its logging
            steps.
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on CPU unless given.
        timeout: how long a collective waits for a rank that does not come (``timedelta`` or seconds; default 10
            minutes); a stuck rank then ends the job and every rank says which rank is stuck (docs/reliability.md).
        async_checkpoint: write checkpoints in the background; the next save and the end of training wait for it.
        checkpoint_verify: on load, check every file against its commit record's size and SHA-256.
        pretrained_weights: start from these weights: a Hugging Face folder (``model.safetensors``, or shards with
            ``model.safetensors.index.json``), ``lightning-hybrid consolidate`` output, or a ``.safetensors`` file.
            Loaded once the model is split, each rank reading only its own slices; ``trainer.fit(ckpt_path=...)``
            overwrites them (docs/checkpoint.md, "Starting from pretrained weights").
        health_checks: add :class:`~lightning_hybrid.HealthChecks` to the callbacks (True, False, or an instance).
        monitor: add :class:`~lightning_hybrid.HybridMonitor` when the Trainer has a logger (True, False, or an
            instance, added even without a logger).
        offload_optimizer: keep fp32 masters and Adam moments in host memory, stepped by DeepSpeedCPUAdam
            (docs/offload.md).
        layout: ``"auto"``: use the planner's best feasible layout for the world size and device memory.
        device_memory: GB per device for ``layout="auto"`` on CPU (on CUDA the device's total memory is used).
        compile: ``torch.compile`` each transformer block in place (regional compilation: one compiled graph per
            block type, reused by every block), after tensor parallel and activation checkpointing, before ZeRO-3
            (docs/compile.md).
        expert_parallel_size: data-parallel ranks that split each MoE layer's experts (docs/expert-parallel.md).
        context_parallel_size: ranks that split each sample's sequence, attention exact (docs/context-parallel.md).
        tensor_parallel: the tensor-parallel options as one :class:`~lightning_hybrid.TensorParallelOptions`
            (``plan``, ``vocab_parallel_loss``, ``verify_tensor_parallel``).
        pipeline: the pipeline options as one :class:`~lightning_hybrid.PipelineOptions` (``num_microbatches``,
            ``schedule``, ``virtual_pipeline_size``, ``partition``, ``network``, ``verify_pipeline``).
        zero: the ZeRO options as one :class:`~lightning_hybrid.ZeroOptions` (``zero3_gradient_sync``,
            ``overlap_grad_reduce``, ``bucket_cap_mb``, ``offload_optimizer``).
        checkpoint: the checkpoint options as one :class:`~lightning_hybrid.CheckpointOptions`
            (``async_checkpoint``, ``verify``, ``pretrained_weights``).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> strategy = HybridStrategy(tensor_parallel_size=2, zero_stage=1)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=10)  # tp=2 x dp=2

        The same layout at tp=2 x pp=2, with the options in their sections:

        >>> from lightning_hybrid import CheckpointOptions, PipelineOptions, TensorParallelOptions, ZeroOptions
        >>> strategy = HybridStrategy(
        ...     tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1,
        ...     tensor_parallel=TensorParallelOptions(plan={"*.mlp.c_fc": "colwise", "*.mlp.c_proj": "rowwise"}),
        ...     pipeline=PipelineOptions(schedule="interleaved_1f1b", virtual_pipeline_size=2, num_microbatches=4),
        ...     zero=ZeroOptions(bucket_cap_mb=50), checkpoint=CheckpointOptions(async_checkpoint=True),
        ... )
        >>> trainer = Trainer(accelerator="cpu", devices=8, strategy=strategy, max_steps=10)  # tp=2 x pp=2 x dp=2

        An option given both ways must agree:

        >>> from lightning_hybrid import HybridConfigError
        >>> try:
        ...     HybridStrategy(bucket_cap_mb=10, zero=ZeroOptions(bucket_cap_mb=50))
        ... except HybridConfigError as error:
        ...     print(str(error).split(". ")[0])
        `bucket_cap_mb=10` and `zero=ZeroOptions(bucket_cap_mb=50.0)` give the same option two different values
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        zero_stage: int = 1,
        tensor_parallel_plan: Union[str, dict[str, Any]] = "auto",
        sequence_parallel: bool = False,
        activation_checkpointing: Union[bool, Literal["full", "selective"]] = False,
        vocab_parallel_loss: bool = True,
        transformer_blocks: Optional[str] = None,
        num_microbatches: Optional[int] = None,
        pipeline_schedule: str = "1f1b",
        virtual_pipeline_size: int = 1,
        pipeline_partition: Union[str, list[int]] = "uniform",
        pipeline_network: Optional[str] = None,
        verify_pipeline: Union[bool, Literal["auto"]] = "auto",
        verify_tensor_parallel: Union[bool, Literal["auto"]] = "auto",
        zero3_gradient_sync: Literal["per_step", "per_microbatch"] = "per_step",
        overlap_grad_reduce: bool = True,
        bucket_cap_mb: float = 25.0,
        track_gradient_norm: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        async_checkpoint: bool = False,
        checkpoint_verify: bool = True,
        pretrained_weights: Optional[str] = None,
        health_checks: Union[bool, Any] = True,
        monitor: Union[bool, HybridMonitor] = True,
        offload_optimizer: bool = False,
        layout: Optional[Literal["auto"]] = None,
        device_memory: Optional[float] = None,
        compile: bool = False,
        expert_parallel_size: int = 1,
        activation_checkpointing_every: int = 1,
        context_parallel_size: int = 1,
        *,
        tensor_parallel: Optional[TensorParallelOptions] = None,
        pipeline: Optional[PipelineOptions] = None,
        zero: Optional[ZeroOptions] = None,
        checkpoint: Optional[CheckpointOptions] = None,
        **kwargs: Any,
    ) -> None:
        # checked now (config.py): every rank runs the constructor, so all raise alike, before any collective exists
        arguments = {name: value for name, value in locals().items() if name in _OPTION_ARGUMENTS}
        super().__init__(**kwargs)
        self._options = StrategyOptions.from_arguments(**arguments)
        check_monitor(monitor)
        self._checkpoint_writer = ShardedCheckpointWriter(asynchronous=self._options.checkpoint.async_checkpoint)
        self._checkpoints = StrategyCheckpoints(self, self._options.checkpoint, self._checkpoint_writer)
        self._timeout = resolve_timeout(timeout)
        self.track_gradient_norm = track_gradient_norm
        """Take the global gradient norm every step (``last_gradient_norm``); HybridMonitor has it taken on its
        logging steps anyway."""
        self._topology: Optional[topology.Topology] = None
        self.parallelized: Optional[Parallelized] = None
        """What :func:`~lightning_hybrid.parallelize.parallelize` returned for the module (None before set-up)."""
        self._parallelized_module: Optional[nn.Module] = None
        self.pretrained: Optional[LoadReport] = None
        """What was loaded from ``pretrained_weights`` on this rank (None without them, or before set-up)."""
        self._pipeline: Optional[PipelineRunner] = None
        self._optimizer_step: Optional[OptimizerStep] = None
        self._monitors: list[HybridMonitor] = []  # they ask for the gradient norm on their logging steps
        self._backward_sync_blocked = False
        self._deferred = DeferredConstruction()
        self._first_batch_unchecked = True
        self.num_nodes = 1

    # ------------------------------------------------------------------ precision
    # Trainer(precision=...) gives Lightning's plugins; the hybrid one clips by the global norm
    precision_plugin = ParallelStrategy.precision_plugin.setter(
        lambda self, plugin: ParallelStrategy.precision_plugin.fset(self, HybridPrecision.from_lightning(plugin))
    )

    # ------------------------------------------------------------------ layout and processes
    @property
    def layout(self) -> ParallelLayout:
        if self._topology is None:
            raise RuntimeError("Accessing the layout before the processes have initialized is not allowed.")
        return self._topology.layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("pipeline", "data", "tensor")`` mesh; also available as ``LightningModule.device_mesh``."""
        if self._topology is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._topology.mesh

    @property
    def _data_group(self) -> Any:  # the data-parallel group (StrategyCheckpoints reads it too)
        return self._topology.data_group if self._topology is not None else None

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning turns off sync_dist and the distributed sampler for strategies it does not know unless this is set
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # replicas split the data: tensor, pipeline and context peers of a replica see the same samples
        data, cp = self.device_mesh["data"], self.layout.context_parallel_size
        return {"num_replicas": data.size() // cp, "rank": data.get_local_rank() // cp}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._topology.backend if self._topology is not None else self._options.process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        compat.set_launcher(self)

    def set_world_ranks(self) -> None:
        compat.set_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        module, options = self.lightning_module, self._options
        assert module is not None
        # resolve the layout from the world size before the process group exists: a bad layout raises on every rank
        machine = {"world_size": self.world_size, "devices_per_node": self.num_processes, "device": self.root_device}
        layout = resolve_layout(options, module, **machine, precision=self.precision_plugin)
        check_before_fit(module, layout)
        self._topology = topology.start_topology(
            layout, self.cluster_environment, self.root_device, self.process_group_backend, self._timeout
        )
        compat.set_module_device_mesh(module, self._topology.mesh)
        add_monitoring_defaults(module.trainer, options.health_checks, options.monitor)

    # ------------------------------------------------------------------ model set-up
    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """What ``configure_model`` and ``trainer.init_module()`` build is made on the meta device and its
        construction recorded; ``setup`` splits and shards it there, then gives each rank only its shards, with the
        values one device's construction gives (``construction/``, docs/big-models.md). ``empty_init`` changes
        nothing: weights are never left as uninitialized memory."""
        device_type = self.root_device.type if self.parallel_devices else "cpu"
        # after setup_environment's seed reset (configure_model), one device's construction moves the generator;
        # before it (trainer.init_module()), the reset discards what the construction drew
        after_seed_reset = self._topology is not None
        with self._deferred.recording(device_type, after_seed_reset=after_seed_reset):
            with self.precision_plugin.tensor_init_context():
                yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_supported(self.precision_plugin)  # what would silently train wrong: refused on every rank alike
        self.precision_plugin.device = self.root_device.type  # autocast's device type
        # Lightning calls setup again for each entry point (fit, validate, test, predict) on the same module: the
        # model is split and sharded once
        if self._parallelized_module is not module:
            options = ModelOptions(
                device=self.root_device,
                activation_checkpointing=self._options.activation_checkpointing,
                activation_checkpointing_every=self._options.activation_checkpointing_every,
                transformer_blocks=self._options.transformer_blocks,
                compile=self._options.compile,
                layer_sync=compat.layer_sync(self),
            )
            deferred = self._deferred.plan(module, pipeline_partition=self.layout.pipeline.partition)
            self.parallelized = parallelize(module, self.layout, self.device_mesh, options, self.precision_plugin,
                                            self._topology.expert_mesh, self._topology.context_mesh)  # fmt: skip
            pretrained = self._options.checkpoint.pretrained_weights
            if deferred is not None:  # built on meta: only now, split, does this rank get memory for its shards
                unsplit_copy = getattr(self.parallelized.verifier, "reference", None)
                self._deferred.materialize(
                    module, deferred, self.root_device, unsplit_copy=unsplit_copy, weights_follow=pretrained is not None
                )
            # the split model's own shards are filled from pretrained weights, before the optimizers (and ZeRO's fp32
            # masters) are made from them; a later ckpt_path resume overwrites them (checkpoint/pretrained.py)
            self.pretrained = load_pretrained_weights(module, pretrained, self.parallelized)
            self._pipeline, self._parallelized_module = self.parallelized.runner, module
            verifier = self.parallelized.verifier
            if verifier is not None:
                # the check's gradients are summed within a replica: over the stages' tied weights and tensor-parallel
                # replicas (verify_pipeline), or the tensor-parallel sums only, since ZeRO's reduction keeps state of
                # its own that the check's dropped gradients must not reach (verify_tensor_parallel)
                pipelined = self._pipeline is not None
                verifier.sync = self.reduce_gradients if pipelined else self.parallelized.gradient_sync
            sync_metrics_over(module, self._data_group)  # torchmetrics: reduce over replicas only
            if self._pipeline is not None:  # Lightning's ModelSummary: one device's counts, not this rank's stages
                summarize_whole_model(trainer.callbacks, module, self._pipeline.network, self._pipeline.split.unsplit)
        # Lightning's model summary runs example_input_array through the model on rank 0 alone: a split model's
        # forward is a collective (TP/ZeRO-3) or needs other stages, so it would hang or fail. Hidden until teardown.
        self._example_input_array, module.example_input_array = module.example_input_array, None
        self.model_to_device()
        self.barrier()
        self._monitors = [c for c in trainer.callbacks if isinstance(c, HybridMonitor)]
        if trainer.state.fn == TrainerFn.FITTING:
            self._first_batch_unchecked = True
            self.setup_optimizers(trainer)
            self._require_optimizer_step().hold_schedulers_on_skipped_steps(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._optimizer_step is not None:  # a second fit on the same strategy: the old buckets stop listening
            self._optimizer_step.gradients.close()
        gradients = GradientStep.for_layout(self.lightning_module, self.optimizers, self.layout, self.device_mesh,
                                            self.parallelized, self.precision_plugin, self.root_device)  # fmt: skip
        self._optimizer_step = OptimizerStep(gradients, self.precision_plugin)
        # Lightning's wrappers subclass each optimizer's class when made: made again, they see the class the ZeRO
        # wrappers gave it (a zero_grad that clears the model's gradients too, not only the masters')
        self.optimizers = self.optimizers

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # under context parallel each context rank keeps its part of the sequence
        topology = self._topology
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return sequence_part(batch, topology.context_rank, self.layout.context_parallel_size) if topology else batch

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return skip_finished_batches(dataloader, self.lightning_module.trainer)  # a mid-epoch resume (data.py)

    # ------------------------------------------------------------------ steps (module_step.py)
    training_step = step_hook("training_step")
    validation_step = step_hook("validation_step")
    test_step = step_hook("test_step")
    predict_step = step_hook("predict_step")

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            # the schedule ran forward and backward inside training_step; keep Lightning's hooks, skip autograd
            module = self.lightning_module
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline.restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def block_backward_sync(self) -> AbstractContextManager[None]:
        """DDP's ``no_sync``: Lightning runs the backward passes of gradient-accumulation batches inside this, so they
        only add into the gradient buckets; the step's last backward pass (inside ``optimizer_step``) reduces them."""
        return attribute_replaced(self, "_backward_sync_blocked", True)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """One training step's gradients and update, in order (``optimizer_step.py``, the step spine)."""
        blocked = self._backward_sync_blocked
        tracked = self.track_gradient_norm or any(m.wants_gradient_norm for m in self._monitors)
        return self._require_optimizer_step().run(
            optimizer,
            closure,
            model or self.lightning_module,
            backward_sync_blocked=blocked,
            track_norm=tracked,
            **kwargs,
        )

    def _require_optimizer_step(self) -> OptimizerStep:
        assert self._optimizer_step is not None, "set up the optimizers first"
        return self._optimizer_step

    # ------------------------------------------------------------------ gradients (optimizer_step.py, sharding/)
    @property
    def gradient_buckets(self) -> list[list[dict[str, int]]]:
        """Per optimizer, per gradient bucket: ``GradientStep.bucket_stats`` (empty before the optimizers)."""
        return self._optimizer_step.gradients.bucket_stats() if self._optimizer_step is not None else []

    @property
    def last_gradient_norm(self) -> Optional[float]:
        """The global gradient norm before clipping at the last optimizer step (None if it overflowed)."""
        return self._optimizer_step.last.norm if self._optimizer_step is not None else None

    @property
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank held at the last optimizer step."""
        return self._optimizer_step.gradients.model_state_bytes if self._optimizer_step is not None else {}

    @property
    def sharded_optimizers(self) -> list[ShardedOptimizer]:
        """The ZeRO-0/1/2 wrappers of the optimizers (none at ZeRO-3 or before the optimizers are set up)."""
        return self._optimizer_step.gradients.sharded if self._optimizer_step is not None else []

    def _sharded_for(self, optimizer: Any) -> Optional[ShardedOptimizer]:
        return self._optimizer_step.gradients.sharded_for(optimizer) if self._optimizer_step is not None else None

    def clip_gradients_by_global_norm(self, max_norm: float) -> float:
        """Clip by the one-device global norm; returns it before clipping (``OptimizerStep.clip``; all ranks)."""
        return self._require_optimizer_step().clip(max_norm)

    def reduce_gradients(self, sharded: Optional[ShardedOptimizer] = None) -> None:
        """Make gradients the single-device ones (``GradientStep.reduce``), once per optimizer step."""
        self._require_optimizer_step().gradients.reduce(sharded)

    def full_gradients(self) -> dict[str, Tensor]:
        """Every reduced gradient, gathered whole (``GradientStep.full_gradients``; collective, all ranks)."""
        return self._require_optimizer_step().gradients.full_gradients()

    def gradient_norms(self, module: nn.Module, norm_type: float = 2.0) -> dict[str, float]:
        """Each gradient's norm by its one-device name (``GradientStep.gradient_norms``; collective, all ranks)."""
        return self._require_optimizer_step().gradients.gradient_norms(module, norm_type)

    @property
    def pipeline_timeline(self) -> Any:
        """This rank's :class:`~lightning_hybrid.pipeline.runner.StepTimeline` of the last pipeline step (None
        without pipeline parallel): per micro-batch forward/backward timings and the measured bubble fraction."""
        return self._pipeline.timeline if self._pipeline is not None else None

    # ------------------------------------------------------------------ checkpoints (checkpoint/strategy_io.py)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # shards load in place into the parallelized model and the (ZeRO-wrapped) optimizers
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with DTensors left sharded: every rank saves only its own shards."""
        return self._checkpoints.module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state. Collective under ZeRO-1/2 (each parameter's state is written by
        one replica): Lightning calls it on all ranks."""
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) as a sharded checkpoint directory at ``filepath`` (all ranks)."""
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Drop an older checkpoint; with async saves, once the newer one is committed."""
        self._checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint in place into the parallelized model and optimizers; returns the rest of Lightning's
        dict (a DeepSpeed checkpoint is converted first)."""
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by load_checkpoint

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        topology.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return topology.broadcast_object(obj, src)

    # ``all_gather`` and ``reduce`` without a group (or with the world group ``LightningModule.all_gather`` passes) work
    # over the data-parallel replicas, as ``"ddp"``'s over its processes: a replica's tensor and pipeline peers hold
    # one value, which a world-wide sum would count once per peer and a world-wide gather would repeat
    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group=self._replicas(group), sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Union[ReduceOp, str, None] = "mean") -> Any:
        return topology.reduce(tensor, self._replicas(group), reduce_op) if isinstance(tensor, Tensor) else tensor

    def _replicas(self, group: Optional[Any]) -> Any:
        return self._data_group if group is None or group is torch.distributed.group.WORLD else group

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # a decision (stop, save) every rank must take alike: counted over the world, as Lightning compares it
        votes = topology.reduce(torch.tensor(int(decision), device=self.root_device), None, "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def teardown(self) -> None:
        """Leave nothing running: also after an exception (Lightning tears down then too), every step below runs, and
        the first error is raised at the end. Nothing here is collective: after an error, other ranks may not come.
        The process groups themselves are destroyed at exit (see ``setup_environment``)."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self.lightning_module is not None:
            if getattr(self, "_example_input_array", None) is not None:
                self.lightning_module.example_input_array = self._example_input_array
            OptimizerStep.release_schedulers(self.lightning_module)
        if self._optimizer_step is not None:  # gradient hooks hold the model from C++, where gc cannot free it
            self._optimizer_step.gradients.close()  # (bucket all-reduces in flight after an error are not waited on)
        if self._topology is not None:
            self._topology.watchdog.stop()
        try:
            # the end of training waits for a background checkpoint save, then destroys the save's own group
            self._checkpoint_writer.close()
        finally:
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # a failed or timed-out collective: report which rank is stuck before the process exits
        if self._topology is not None:
            self._topology.watchdog.on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="3D parallel: tensor x pipeline x data (ZeRO)")
