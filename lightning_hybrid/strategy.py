"""HybridStrategy: the Lightning glue that composes the mesh, tensor parallel, the pipeline and ZeRO.

The logic lives in the per-concern modules (docs/architecture.md): the options in ``options.py``, processes and mesh
in ``topology.py``, the model's set-up in ``model_setup.py`` (model surgery: ``parallelize.py``), a training step in
``optimizer_step.py`` (the step spine), checkpoint I/O in ``checkpoint/``; this class decides *when* each runs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Optional, Union

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
from lightning_hybrid.checkpoint.pretrained import LoadReport
from lightning_hybrid.checkpoint.strategy_io import StrategyCheckpoints, checkpoint_hook
from lightning_hybrid.construction.deferred import DeferredConstruction
from lightning_hybrid.data import release_quieted, sequence_part, skip_finished_batches
from lightning_hybrid.layout import ParallelLayout
from lightning_hybrid.model_setup import set_up_module
from lightning_hybrid.module_step import check_before_fit, step_hook
from lightning_hybrid.monitoring.callback import HybridMonitor
from lightning_hybrid.monitoring.health import add_monitoring_defaults
from lightning_hybrid.optimizer_step import OptimizerStep, pipelined_backward, spine_hook
from lightning_hybrid.options import StrategyOptions, flat_constructor
from lightning_hybrid.parallelize import Parallelized
from lightning_hybrid.pipeline import PipelineRunner
from lightning_hybrid.precision import HybridPrecision, check_supported
from lightning_hybrid.sharding.gradient_step import GradientStep
from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HybridStrategy"]


class HybridStrategy(ParallelStrategy):
    """Train any LightningModule in 3D parallel: tensor x pipeline x data parallel with ZeRO sharding.

    Each option is given flat (``pipeline_schedule="gpipe"``, as LightningCLI/YAML give them) or in its typed section
    (``pipeline=PipelineOptions(schedule="gpipe")``): the arguments, listed under ``__init__``, are read from the one
    definition of each option (``lightning_hybrid/options.py``). An option given both ways must agree; a flat argument
    at its default counts as not given. A bad option raises :class:`~lightning_hybrid.HybridConfigError` here, alike on
    every rank.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> strategy = HybridStrategy(tensor_parallel_size=2, zero_stage=1)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=10)  # tp=2 x dp=2
        >>> from lightning_hybrid import PipelineOptions  # tp=2 x pp=2 x dp=2, the pipeline's options in their section
        >>> strategy = HybridStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, bucket_cap_mb=50,
        ...                           pipeline=PipelineOptions(schedule="gpipe", num_microbatches=4))
        >>> trainer = Trainer(accelerator="cpu", devices=8, strategy=strategy, max_steps=10)
    """

    strategy_name = "hybrid"

    @flat_constructor(ParallelStrategy.__init__)
    def __init__(self, options: StrategyOptions, **lightning: Any) -> None:
        """Every option by keyword, flat or in its section, checked before this runs (``options.py``); Lightning's
        ``ParallelStrategy`` arguments besides, which the Trainer sets."""
        super().__init__(**lightning)
        self._options = options
        self._checkpoint_writer = ShardedCheckpointWriter(asynchronous=self._options.checkpoint.async_checkpoint)
        self._checkpoints = StrategyCheckpoints(self, self._options.checkpoint, self._checkpoint_writer)
        self.track_gradient_norm = options.track_gradient_norm
        """Take the global gradient norm every step (``last_gradient_norm``; HybridMonitor asks on logging steps)."""
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
        layout = options.layout_for(module, **machine, precision=self.precision_plugin)
        check_before_fit(module, layout)
        self._topology = topology.start_topology(
            layout, self.cluster_environment, self.root_device, self.process_group_backend, options.timeout
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
            options = self._options.model_options(self.root_device, compat.layer_sync(self))
            self.parallelized, self.pretrained = set_up_module(
                module, self._topology, options, self.precision_plugin, deferred=self._deferred,
                pretrained_weights=self._options.checkpoint.pretrained_weights, callbacks=trainer.callbacks,
                reduce_gradients=self.reduce_gradients,
            )  # fmt: skip
            self._pipeline, self._parallelized_module = self.parallelized.runner, module
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
        self.setup_precision_plugin()  # its connect() sets the optimizers again: Lightning's wrappers are made after
        if self._optimizer_step is not None:  # zero_grad of an optimizer of masters clears the model's too
            self._optimizer_step.gradients.wrap_lightning_optimizers(self)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._optimizer_step is not None:  # a second fit on the same strategy: the old buckets stop listening
            self._optimizer_step.gradients.close()
        gradients = GradientStep.for_layout(self.lightning_module, self.optimizers, self.layout, self.device_mesh,
                                            self.parallelized, self.precision_plugin, self.root_device)  # fmt: skip
        self._optimizer_step = OptimizerStep(gradients, self.precision_plugin)

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

    def _finish_sending(self) -> None:  # at a run's end no next step waits for the last stage's broadcast of results
        self._pipeline.finish_sending() if self._pipeline is not None else None

    on_train_end = on_validation_end = on_test_end = on_predict_end = _finish_sending

    def _share_random_state(self) -> None:  # a replica's ranks compute one micro-batch: its draws must agree
        topology.share_random_state(self._topology, self.root_device)

    on_train_start = on_validation_start = on_test_start = on_predict_start = _share_random_state

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:  # the schedule ran the backward inside training_step: its gradients, restored
            return pipelined_backward(self, self._pipeline, closure_loss)
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
        module = model or self.lightning_module
        spine = self._require_optimizer_step()
        return spine.run(optimizer, closure, module, backward_sync_blocked=blocked, track_norm=tracked, **kwargs)

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

    clip_gradients_by_global_norm = spine_hook(OptimizerStep.clip)
    reduce_gradients = spine_hook(GradientStep.reduce)
    full_gradients = spine_hook(GradientStep.full_gradients)
    gradient_norms = spine_hook(GradientStep.gradient_norms)

    @property
    def pipeline_timeline(self) -> Any:
        """This rank's :class:`~lightning_hybrid.pipeline.runner.StepTimeline` of the last pipeline step (None
        without pipeline parallel): per micro-batch forward/backward timings and the measured bubble fraction."""
        return self._pipeline.timeline if self._pipeline is not None else None

    # ------------------------------------------------------------------ checkpoints (checkpoint/strategy_io.py)
    # shards load in place into the parallelized model and the (ZeRO-wrapped) optimizers, once they are set up
    restore_checkpoint_after_setup = True
    lightning_restore_optimizer = False
    lightning_module_state_dict = checkpoint_hook(StrategyCheckpoints.module_state_dict)
    optimizer_state = checkpoint_hook(StrategyCheckpoints.optimizer_state)
    save_checkpoint = checkpoint_hook(StrategyCheckpoints.save)
    remove_checkpoint = checkpoint_hook(StrategyCheckpoints.remove)
    load_checkpoint = checkpoint_hook(StrategyCheckpoints.load)

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
        """Leave nothing running, also after an exception (Lightning tears down then too); nothing here is collective:
        after an error, other ranks may not come. The process groups are destroyed at exit (``setup_environment``)."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self.lightning_module is not None:
            if getattr(self, "_example_input_array", None) is not None:
                self.lightning_module.example_input_array = self._example_input_array
            OptimizerStep.release_schedulers(self.lightning_module)
        if self._optimizer_step is not None:  # gradient hooks hold the model from C++, where gc cannot free it
            self._optimizer_step.gradients.close()  # (bucket all-reduces in flight after an error are not waited on)
        self._pipeline.close() if self._pipeline is not None else None  # the paused steps' worker threads
        if self._topology is not None:
            self._topology.watchdog.stop()
        release_quieted()  # Lightning's warning about a loader resumed mid-epoch, silenced where it was restored
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
