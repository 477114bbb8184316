"""HybridStrategy: the Lightning glue that composes the mesh, tensor parallel, the pipeline and ZeRO.

The logic lives in the per-concern packages; this class only decides *when* each runs in Lightning's loop.
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid.agreement import computed_on_one_rank, raise_together
from lightning_hybrid.checkpoint import (
    LAYOUT_KEY,
    VERSIONS_KEY,
    ShardedCheckpointWriter,
    checkpoint_to_load,
    full_tensor,
    load_sharded,
    read_meta,
)
from lightning_hybrid.checkpoint import optimizer_state as checkpoint_optimizer_state
from lightning_hybrid.config import HybridConfigError, ParallelLayout, check_pipeline, check_sizes
from lightning_hybrid.data import SkipOnResume
from lightning_hybrid.monitoring.callback import HybridMonitor
from lightning_hybrid.monitoring.health import add_monitoring_defaults
from lightning_hybrid.monitoring.metrics import sync_metrics_over
from lightning_hybrid.pipeline import PipelineRunner, StageModule, partition_blocks, split_network, to_plain
from lightning_hybrid.pipeline.profile import stage_costs
from lightning_hybrid.pipeline.shared import SharedParameters, find_shared_parameters
from lightning_hybrid.pipeline.stage import InputStub
from lightning_hybrid.pipeline.verify import check_verify_pipeline, make_verifier
from lightning_hybrid.planning.auto import check_auto_layout
from lightning_hybrid.precision import PRECISIONS, HybridPrecision
from lightning_hybrid.sharding import (
    GradientSync,
    ShardedOptimizer,
    apply_fully_shard,
    check_user_sharding,
    measure_model_state_bytes,
    sync_batch_norm,
)
from lightning_hybrid.sharding.norm import GradientNorm
from lightning_hybrid.structure import ModelStructure, block_list_needed_by, find_model_structure
from lightning_hybrid.tensor_parallel import (
    apply_tensor_parallel,
    build_tensor_parallel_plan,
    validate_tensor_parallel_plan,
)
from lightning_hybrid.topology import build_device_mesh, format_rank_table, gather_rank_devices, with_lightning_names
from lightning_hybrid.watchdog import DEFAULT_TIMEOUT, HangWatchdog, configure_flight_recorder, resolve_timeout

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HybridStrategy"]

# the precision plugin's context for each step (autocast / default dtype), as Lightning's own strategies use them
_STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class HybridStrategy(ParallelStrategy):
    """Train any LightningModule in 3D parallel: tensor x pipeline x data parallel with ZeRO sharding.

    Arguments:
        tensor_parallel_size: ranks that split each layer (DTensor). Consecutive ranks, so keep it within a node.
        pipeline_parallel_size: ranks that split the stack of blocks into stages (slowest mesh dimension).
        data_parallel_size: model replicas; ``"auto"`` is ``world_size // (tensor x pipeline)``.
        zero_stage: 0 replicate, 1 shard optimizer state, 2 also gradients, 3 also parameters (FSDP2).
        tensor_parallel_plan: ``"auto"`` (find the plan; Hugging Face models use the plan they declare), or a dict
            ``{module-name pattern: "colwise" | "rowwise" | ParallelStyle}``. If ``configure_model`` already
            parallelized the model with ``self.device_mesh["tensor"]``, the plan is not applied.
        sequence_parallel: shard norm/dropout activations along the sequence (Megatron-SP); needs tensor parallel.
        activation_checkpointing: recompute each transformer block in the backward pass instead of storing it.
        vocab_parallel_loss: keep the logits sharded over the vocabulary so cross-entropy never gathers them.
        transformer_blocks: name of the repeated block list when it cannot be found automatically.
        num_microbatches: micro-batches per optimizer step under pipeline parallel (default: the pipeline size);
            must divide the DataLoader's batch size.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"`` or
            ``"zbv_zero_bubble"`` (torch's ``pipelining`` schedules).
        virtual_pipeline_size: stages per rank for the interleaved and zero-bubble schedules.
        pipeline_partition: ``"uniform"``, ``"parameters"``, ``"profile"`` or block counts per stage.
        pipeline_network: name of the module ``training_step`` calls, if not the one owning the block list.
        verify_pipeline: on the first batch, compare the pipelined loss and gradient norm of one micro-batch with an
            unsplit forward of a copy of the network on one rank, and refuse the run on a mismatch. ``"auto"``: on
            for fp32 models of at most 100M parameters; ``True``: always; ``False``: off (the structural checks of
            the first step still run). See docs/pipeline.md.
        zero3_gradient_sync: ZeRO-3 under pipeline parallel: ``"per_step"`` keeps each stage's gradients unsharded
            across micro-batches and reduce-scatters once per step (more memory, less communication);
            ``"per_microbatch"`` reduce-scatters and frees them after every micro-batch's backward.
        overlap_grad_reduce: at ``zero_stage=0`` without pipeline parallel (and without a ``-true`` precision's master
            weights), average the gradients over the data-parallel replicas in buckets during the step's last
            backward pass, overlapping communication with backward as DDP does; at ``zero_stage=2`` without pipeline
            parallel, reduce each bucket to the ranks that own its shard during every backward pass, so no rank holds
            the full gradient; ``False``: one reduction of all gradients after backward.
        bucket_cap_mb: size of those buckets in MiB (DDP's ``bucket_cap_mb``; the first bucket is at most 1 MiB).
        track_gradient_norm: take the global gradient norm (before clipping) every step into
            ``strategy.last_gradient_norm`` (one pass over the gradients and a scalar all-reduce). Clipping by norm
            takes it anyway; :class:`~lightning_hybrid.monitoring.HybridMonitor` turns this on.
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on CPU unless given.
        timeout: how long a collective waits for a rank that does not come (a ``datetime.timedelta`` or seconds;
            default 10 minutes), on every process group of the mesh. A stuck rank (stopped, deadlocked) then ends
            the job within this time plus 30 s, and every rank prints which rank is stuck and the collective and
            mesh dimension each rank waits in (``lightning_hybrid.watchdog``; see docs/reliability.md).
        async_checkpoint: write checkpoints in the background (``torch.distributed.checkpoint.async_save``): a save
            copies this rank's shards to CPU memory and training goes on while they are written; the next save and
            the end of training wait for it. The checkpoint appears under its name only once complete, as with
            synchronous saves.
        checkpoint_verify: on load, check every file of the checkpoint against the size and SHA-256 its commit record
            holds (each rank hashes its share of the files: about 1-2 s of one core per GB), and let
            ``ckpt_path="last"`` skip a checkpoint that fails for the newest one in its directory that passes.
            ``False`` loads without hashing (sizes are still checked), also checkpoints without a commit record.
            Saves always write the record.
        health_checks: add :class:`~lightning_hybrid.monitoring.HealthChecks` to the Trainer's callbacks (rank-to-device
            map, layout/version agreement and clock skew at start-up; data-parallel replica checksums every 1000
            steps). ``False`` turns them off; a ``HealthChecks(...)`` instance chooses the checks. Not added twice if
            the callbacks already hold one.
        monitor: add :class:`~lightning_hybrid.monitoring.HybridMonitor` to the Trainer's callbacks whenever it has a
            logger, so every logger gets the 3D metrics (loss, LR, gradient norm, loss scale, skipped steps, tokens/s,
            MFU, memory, communication share per mesh dimension, pipeline bubble) and the layout in its run config.
            ``False`` turns it off; a ``HybridMonitor(...)`` instance chooses the settings (and is added even
            without a logger). Not added twice if the callbacks already hold one.
        offload_optimizer: keep this rank's fp32 master weights and Adam moments in host memory and step them with
            DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload; needs ``pip install "lightning-hybrid[deepspeed]"`` and a
            torch Adam/AdamW optimizer). The device keeps parameters and gradients only (docs/offload.md).
        layout: ``"auto"``: at set-up, take the world size and the device memory and use the planner's best feasible
            layout (``lightning_hybrid.plan``), logged with its memory ledger. Give no explicit sizes with it.
        device_memory: GB per device for ``layout="auto"`` on CPU (on CUDA the device's total memory is used).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> strategy = HybridStrategy(tensor_parallel_size=2, zero_stage=1)
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=10)  # tp=2 x dp=2
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
        activation_checkpointing: bool = False,
        vocab_parallel_loss: bool = True,
        transformer_blocks: Optional[str] = None,
        num_microbatches: Optional[int] = None,
        pipeline_schedule: str = "1f1b",
        virtual_pipeline_size: int = 1,
        pipeline_partition: Union[str, list[int]] = "uniform",
        pipeline_network: Optional[str] = None,
        verify_pipeline: Union[bool, Literal["auto"]] = "auto",
        zero3_gradient_sync: Literal["per_step", "per_microbatch"] = "per_step",
        overlap_grad_reduce: bool = True,
        bucket_cap_mb: float = 25.0,
        track_gradient_norm: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
        async_checkpoint: bool = False,
        checkpoint_verify: bool = True,
        health_checks: Union[bool, Any] = True,
        monitor: Union[bool, HybridMonitor] = True,
        offload_optimizer: bool = False,
        layout: Optional[Literal["auto"]] = None,
        device_memory: Optional[float] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Validate what needs no world size now: every rank runs this constructor, so all raise alike, collective-free.
        check_sizes(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
        )
        check_pipeline(
            pipeline_parallel_size=pipeline_parallel_size,
            num_microbatches=num_microbatches,
            pipeline_schedule=pipeline_schedule,
            virtual_pipeline_size=virtual_pipeline_size,
            pipeline_partition=pipeline_partition,
        )
        if not (tensor_parallel_plan == "auto" or isinstance(tensor_parallel_plan, dict)):
            raise HybridConfigError(
                f"`tensor_parallel_plan` must be 'auto' or a dict {{module-name pattern: style}}, got"
                f" {tensor_parallel_plan!r}."
            )
        self._sizes = {
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "data_parallel_size": data_parallel_size,
            "zero_stage": zero_stage,
            "sequence_parallel": sequence_parallel,
        }
        self._tensor_parallel_plan = tensor_parallel_plan
        self._pipeline_options = {
            "num_microbatches": num_microbatches or pipeline_parallel_size,
            "pipeline_schedule": pipeline_schedule,
            "virtual_pipeline_size": virtual_pipeline_size,
            "pipeline_partition": pipeline_partition,
        }
        self._pipeline_network = pipeline_network
        check_verify_pipeline(verify_pipeline)
        self._verify_pipeline = verify_pipeline
        if zero3_gradient_sync not in ("per_step", "per_microbatch"):
            raise HybridConfigError(
                f"`zero3_gradient_sync` must be 'per_step' or 'per_microbatch', got {zero3_gradient_sync!r}."
            )
        self._zero3_gradient_sync = zero3_gradient_sync
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise HybridConfigError(f"`bucket_cap_mb` must be a positive number of MiB, got {bucket_cap_mb!r}.")
        self._overlap_grad_reduce = overlap_grad_reduce
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._backward_sync_blocked = False
        self.track_gradient_norm = track_gradient_norm
        """Take the global gradient norm every step (``last_gradient_norm``); HybridMonitor turns it on."""
        self._activation_checkpointing = activation_checkpointing
        self._vocab_parallel_loss = vocab_parallel_loss
        self._transformer_blocks = transformer_blocks
        self._process_group_backend = process_group_backend
        self._timeout = resolve_timeout(timeout)
        self._watchdog: Optional[HangWatchdog] = None
        self._checkpoint_writer = ShardedCheckpointWriter(asynchronous=async_checkpoint)
        self._checkpoint_verify = checkpoint_verify
        self._health_checks = health_checks
        if not isinstance(monitor, (bool, HybridMonitor)):
            raise HybridConfigError(
                f"`monitor={monitor!r}`: pass True (add HybridMonitor() when the Trainer has a logger), False, or a"
                " `lightning_hybrid.HybridMonitor(...)` instance."
            )
        self._monitor = monitor
        self._offload_optimizer = bool(offload_optimizer)
        self._offloads: list[Any] = []
        check_auto_layout(layout, self._sizes, num_microbatches)
        self._auto_layout = layout == "auto"
        self._device_memory = device_memory
        self._layout: Optional[ParallelLayout] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._structure: Optional[ModelStructure] = None
        self._vocab_parallel_head: Optional[str] = None
        self._gradient_sync: Optional[GradientSync] = None
        self._sharded_optimizers: list[ShardedOptimizer] = []
        self._pipeline: Optional[PipelineRunner] = None
        self._tied_sync: Optional[Callable[[], None]] = None
        self._tied_duplicates: list[nn.Parameter] = []
        self._shared: Optional[SharedParameters] = None
        self._gradient_norm: Optional[GradientNorm] = None
        self._parallelized: Optional[nn.Module] = None
        self.last_gradient_norm: Optional[float] = None
        """The global gradient norm before clipping at the last optimizer step (None if it overflowed)."""
        self._step_norm: Optional[float] = None
        self.model_state_bytes: dict[str, int] = {}
        self._model_state_settled = False
        """Bytes of parameters, gradients and optimizer state this rank held at the last optimizer step."""
        self.num_nodes = 1

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> Any:
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Trainer(precision=...) gives Lightning's plugins; the hybrid one clips by the global norm
        self._precision_plugin = HybridPrecision.from_lightning(plugin)

    # ------------------------------------------------------------------ layout and processes
    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("Accessing the layout before the processes have initialized is not allowed.")
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("pipeline", "data", "tensor")`` mesh; also available as ``LightningModule.device_mesh``."""
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

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
        # only the data dimension splits the data: tensor (and pipeline) peers of a replica see the identical batch
        data = self.device_mesh["data"]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # resolve the layout from the world size before the process group exists: a bad layout raises on every rank
        if self._auto_layout:  # the planner's best feasible layout for this world size and device memory
            self._plan_layout()
        pipeline_extras = self._pipeline_options if self._sizes["pipeline_parallel_size"] > 1 else {}
        self._layout = ParallelLayout.resolve(world_size=self.world_size, **self._sizes, **pipeline_extras)
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        created = not _distributed_is_initialized()
        configure_flight_recorder(self._process_group_backend)  # before the groups exist
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if created:
            # Destroy every process group at exit, while the interpreter is still whole. Lightning registers this for
            # NCCL only; a gloo group left to interpreter finalization can abort the finished process ("terminate
            # called without an active exception"): its worker threads release tensors, which takes the GIL, and a
            # thread taking the GIL during finalization is ended by pthread_exit. A no-op if already destroyed.
            atexit.register(_destroy_groups_at_exit)
        # also answers to the dimension names of Lightning's ModelParallelStrategy ("data_parallel", ...)
        self._device_mesh = with_lightning_names(build_device_mesh(self._layout, self.root_device.type, self._timeout))
        self._watchdog = HangWatchdog(self._device_mesh, self._timeout, self._process_group_backend)
        self._watchdog.start()
        self._data_group = self._device_mesh["data"].get_group()  # slicing a mesh builds a new one: once, not per step
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        table = format_rank_table(self._layout, gather_rank_devices(self.root_device))
        rank_zero_info(table)
        add_monitoring_defaults(self.lightning_module.trainer, self._health_checks, self._monitor)

    def _plan_layout(self) -> None:
        from lightning_hybrid.planning.auto import auto_layout

        sizes, num_microbatches, message = auto_layout(
            self.lightning_module,
            world_size=self.world_size,
            devices_per_node=self.num_processes,
            device=self.root_device,
            device_memory=self._device_memory,
            precision=str(getattr(self.precision_plugin, "precision", "32-true")),
            activation_checkpointing=self._activation_checkpointing,
            schedule=self._pipeline_options["pipeline_schedule"],
            virtual_stages=self._pipeline_options["virtual_pipeline_size"],
            sequence_parallel=self._sizes["sequence_parallel"],
        )
        self._sizes.update(sizes)
        self._pipeline_options["num_microbatches"] = num_microbatches or sizes["pipeline_parallel_size"]
        rank_zero_info(message)

    # ------------------------------------------------------------------ model set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._check_unsupported(trainer)
        self.precision_plugin.device = self.root_device.type  # autocast's device type
        # Lightning calls setup again for each entry point (fit, validate, test, predict) on the same module: the
        # model is split and sharded once
        if self._parallelized is not module:
            self._parallelize(module)
            self._parallelized = module
            sync_metrics_over(module, self.device_mesh["data"].get_group())  # torchmetrics: reduce over replicas only
        # Lightning's model summary runs example_input_array through the model on rank 0 alone: a split model's
        # forward is a collective (TP/ZeRO-3) or needs other stages, so it would hang or fail. Hidden until teardown.
        self._example_input_array, module.example_input_array = module.example_input_array, None
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._hold_schedulers_on_skipped_steps(trainer)
        self.setup_precision_plugin()

    def _parallelize(self, module: pl.LightningModule) -> None:
        """Order matters: plan on the whole model (so every rank validates the same thing), cut into stages, then
        tensor parallel, activation checkpointing, ZeRO-3, each on what this rank holds."""
        layout = self.layout
        mesh = self.device_mesh
        user_parallelized = any(isinstance(p, DTensor) for p in module.parameters())
        auto_plan = layout.tensor_parallel_size > 1 and not user_parallelized and self._tensor_parallel_plan == "auto"
        needed_by = block_list_needed_by(
            pipeline_parallel_size=layout.pipeline_parallel_size,
            activation_checkpointing=self._activation_checkpointing,
            tensor_parallel_auto_plan=auto_plan,
            sequence_parallel=layout.sequence_parallel,
        )
        plan = None
        with raise_together():  # planning is collective-free: a failure on any rank is raised on all of them
            # Trainer(sync_batchnorm=True): SyncBatchNorm over the data-parallel group
            sync_batch_norm(module, self._layer_sync, self._data_group, self.root_device.type)
            check_user_sharding(module, layout.zero_stage)  # configure_model's own fully_shard is ZeRO-3
            # data parallel and ZeRO train any module: only these settings need a block list
            self._structure = structure = find_model_structure(module, self._transformer_blocks, needed_by)
            if layout.tensor_parallel_size > 1 and not user_parallelized:
                plan = build_tensor_parallel_plan(
                    module, structure, self._tensor_parallel_plan, vocab_parallel_loss=self._vocab_parallel_loss
                )
                validate_tensor_parallel_plan(module, plan, layout.tensor_parallel_size)
        split = self._cut_pipeline(module, structure) if layout.pipeline_parallel_size > 1 else None
        replicated: list[tuple[str, str]] = []
        if plan is not None:
            if split is not None:
                plan.restrict_to(module)
            pairs = apply_tensor_parallel(
                module, structure, plan, mesh["tensor"], sequence_parallel=layout.sequence_parallel
            )
            named = {id(p): n for n, p in module.named_parameters()}
            replicated = [(named[id(p)], op) for p, op in pairs]
            self._vocab_parallel_head = plan.vocab_parallel_head
            rank_zero_info("lightning-hybrid tensor-parallel plan:\n" + plan.describe())
        elif user_parallelized and layout.tensor_parallel_size > 1:
            if layout.sequence_parallel:
                raise HybridConfigError(
                    "`sequence_parallel=True` is applied with the automatic/dict plan, but `configure_model` already"
                    " parallelized the model. Add SequenceParallel styles to your own plan and leave"
                    " `sequence_parallel=False`."
                )
            replicated = [(n, "avg") for n, p in module.named_parameters() if not isinstance(p, DTensor)]
        held_blocks = [n for n in structure.block_names() if not _is_stub(module.get_submodule(n))]
        if layout.zero_stage < 3:
            # '-true' precisions: low-precision parameters (the optimizer keeps fp32 masters); ZeRO-3 instead keeps
            # fp32 shards as the masters and lets FSDP2 cast them for compute (its MixedPrecisionPolicy)
            self.precision_plugin.convert_module(module)
        if self.precision_plugin.master_dtype is not None:
            # stand-ins for other stages' input modules must produce what those modules now compute in
            for stub in module.modules():
                if isinstance(stub, InputStub) and stub.dtype.is_floating_point:
                    stub.dtype = self.precision_plugin.compute_dtype
        if self._activation_checkpointing:
            from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(module, held_blocks)
        dp_replicated: list[str] = []
        if layout.zero_stage == 3:
            # fully_shard is collective-free at set-up, and what it leaves out depends on the stage a rank holds
            with raise_together():
                # each pipeline stage module becomes the FSDP2 root of its own parameters (below)
                roots = structure.fully_shard_roots(module) if split is None else None
                dp_replicated = apply_fully_shard(module, held_blocks, roots, mesh["data"], **self._fsdp_kwargs())
                if dp_replicated and self.precision_plugin.master_dtype is not None:
                    raise HybridConfigError(
                        f"`precision={self.precision_plugin.precision!r}` with `zero_stage=3` cannot hold"
                        f" {dp_replicated}: FSDP2 leaves them out (fused tensor-parallel biases, or parameters the"
                        " LightningModule holds itself), so nothing casts them. Use zero_stage=1 or 2 with this"
                        " precision, a '-mixed' precision with zero_stage=3, or move such parameters into a submodule."
                    )
        if split is not None:
            self._pipeline = self._build_runner(module, structure, split)
            if self._verifier is not None:  # within a replica: tensor-parallel and shared-parameter sums
                self._verifier.sync, self._verifier.duplicates = self.reduce_gradients, lambda: self._tied_duplicates
                self._pipeline.verifier = self._verifier
            self._tied_sync = self._tied_gradient_sync(module, structure, split)
            if layout.zero_stage == 3:
                dp_replicated += self._shared.loose  # in no stage's FSDP2 root: averaged over data like those left out
        self._gradient_sync = GradientSync(module, replicated, mesh["tensor"], dp_replicated, mesh["data"])

    def _fsdp_kwargs(self) -> dict[str, Any]:
        """FSDP2 arguments for ZeRO-3: under '-true' precisions the fp32 shards are the master weights, cast to the
        low precision for compute, with gradients reduced and accumulated in fp32. Under pipeline parallel the
        parameters stay gathered from forward to backward (as torchtitan does): otherwise every micro-batch's
        backward gathers them again, nearly doubling the data-parallel traffic."""
        kwargs: dict[str, Any] = {}
        if self.layout.pipeline_parallel_size > 1:
            kwargs["reshard_after_forward"] = False
        plugin = self.precision_plugin
        if plugin.master_dtype is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=plugin.compute_dtype, reduce_dtype=plugin.master_dtype)
            kwargs["mp_policy"] = policy
        return kwargs

    def _cut_pipeline(self, module: pl.LightningModule, structure: ModelStructure) -> Any:
        layout, options = self.layout, self._pipeline_options
        with raise_together():
            _, network, blocks_rel = _pipeline_network(module, structure, self._pipeline_network)
        partition = options["pipeline_partition"]
        costs: Optional[list[float]] = None
        first_cost = last_cost = 0.0
        if partition in ("parameters", "profile"):
            example = getattr(module, "example_input_array", None)
            measure = functools.partial(stage_costs, network, blocks_rel, partition, example)
            if partition == "profile":
                # timings differ between ranks: one rank measures, all use its numbers (or raise its error), so all
                # cut alike
                costs, first_cost, last_cost = computed_on_one_rank(measure, src=0)
            else:
                with raise_together():
                    costs, first_cost, last_cost = measure()
        with raise_together():  # the cut depends on the pipeline rank: a failure on one stage is raised on all
            stage_plan = partition_blocks(
                len(module.get_submodule(structure.blocks_name)),
                layout.pipeline_parallel_size,
                options["virtual_pipeline_size"],
                partition,
                block_costs=costs,
                first_cost=first_cost,
                last_cost=last_cost,
                owner_style="v" if options["pipeline_schedule"] == "zbv_zero_bubble" else "loop",
            )
            pipeline_rank = self.device_mesh["pipeline"].get_local_rank()
            # before the cut: the reference rank copies the whole network
            self._verifier = make_verifier(
                self._verify_pipeline,
                module,
                network,
                self.device_mesh,
                precision=self.precision_plugin.precision,
                last_stage_rank=stage_plan.owner[-1],
            )
            split = split_network(network, blocks_rel, stage_plan, pipeline_rank)
        unit = "seconds" if partition == "profile" else "params"
        rank_zero_info("lightning-hybrid pipeline stages:\n" + stage_plan.format_table(unit))
        self._pipeline_network_module = network
        return split

    def _build_runner(self, module: pl.LightningModule, structure: ModelStructure, split: Any) -> PipelineRunner:
        layout = self.layout
        tp = layout.tensor_parallel_size

        def activation_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
            # with sequence parallel, what crosses stages is this rank's slice of the sequence
            return (shape[0], shape[1] // tp, *shape[2:]) if layout.sequence_parallel else shape

        def wrap_stage(stage: StageModule) -> StageModule:
            if layout.zero_stage != 3:
                return stage
            from torch.distributed.fsdp import fully_shard

            if self._zero3_gradient_sync == "per_step":
                # the stage module is the FSDP2 root: torch's PipelineStage then accumulates unsharded gradients
                # over micro-batches and reduce-scatters once per step
                fully_shard(stage, mesh=self.device_mesh["data"], **self._fsdp_kwargs())
            else:
                # every block (and each input/output module) is its own FSDP2 root, which reduce-scatters its
                # gradients and frees the unsharded ones after each micro-batch's backward
                for part in stage.parts:
                    if not isinstance(part, FSDPModule):
                        fully_shard(part, mesh=self.device_mesh["data"], **self._fsdp_kwargs())
            return stage

        return PipelineRunner(
            module,
            self._pipeline_network_module,
            split,
            self.device_mesh["pipeline"],
            self.root_device,
            schedule=self._pipeline_options["pipeline_schedule"],
            num_microbatches=self._pipeline_options["num_microbatches"],
            activation_shape=activation_shape,
            wrap_stage=wrap_stage,
        )

    def _tied_gradient_sync(
        self, module: pl.LightningModule, structure: ModelStructure, split: Any
    ) -> Optional[Callable[[], None]]:
        """Parameters several pipeline ranks hold (tied weights on different stages, bare parameters outside every
        stage's modules): their gradients are summed over the holders every step, and the lowest holder owns them
        (pipeline/shared.py). Collective at set-up: every rank calls it."""
        self._shared = shared = find_shared_parameters(module, split, structure.tied_parameters, self.device_mesh)
        self._tied_duplicates = shared.duplicates  # counted once in the global norm: on the owning stage
        return shared.sync if shared.groups else None

    def _check_unsupported(self, trainer: pl.Trainer) -> None:
        """Refuse, on every rank alike, what would silently train wrong in this release."""
        if not isinstance(self.precision_plugin, HybridPrecision):
            name = getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__)
            raise HybridConfigError(
                f"`Trainer(precision={name!r})` is not supported by HybridStrategy: use one of"
                f" {list(PRECISIONS)}, or pass `plugins=[HybridPrecision(...)]`."
            )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        stage = self.layout.zero_stage
        # the pipeline's schedule runs every micro-batch's backward inside training_step and stashes gradients
        # itself (pipeline/runner.py): it keeps the reduction after the last backward (ZeRO-2 included)
        overlap = self._overlap_grad_reduce and self.layout.pipeline_parallel_size == 1
        bucket_cap_mb = self._bucket_cap_mb if overlap else None
        for z in self._sharded_optimizers:  # a second fit on the same strategy: the old buckets stop listening
            if z.buckets is not None:
                z.buckets.remove_hooks()
        self._sharded_optimizers = (
            [
                ShardedOptimizer(
                    opt,
                    stage=stage,
                    dp_mesh=self.device_mesh["data"],
                    master_dtype=self.precision_plugin.master_dtype,
                    bucket_cap_mb=bucket_cap_mb,
                    tensor_sync=self._gradient_sync,  # ZeRO-2 buckets apply it per bucket, before reducing
                    parameter_order=list(self.lightning_module.parameters()),  # reversed: the order of backward
                    host_masters=self._offload_optimizer,
                )
                for opt in self.optimizers
            ]
            if stage < 3
            else []
        )
        self._gradient_norm = GradientNorm(
            self.lightning_module, self._sharded_optimizers, self.device_mesh, stage, self._tied_duplicates
        )
        if isinstance(self.precision_plugin, HybridPrecision):
            self.precision_plugin._clip_by_norm = self.clip_gradients_by_global_norm
        if self._offload_optimizer:
            from lightning_hybrid.sharding.offload import attach_offload

            self._offloads = attach_offload(self.optimizers, [self._sharded_for(o) for o in self.optimizers])

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        # batches of the interrupted epoch whose step finished (a checkpoint is taken in on_train_batch_end, before
        # Lightning counts the batch "completed"); none to skip when the epoch itself had finished
        done = epoch_loop.batch_progress.current.processed
        size = len(dataloader) if hasattr(dataloader, "__len__") else None
        if trainer.training and trainer.fit_loop.restarting and 0 < done and (size is None or done < size):
            return SkipOnResume(dataloader, done)
        return dataloader

    # ------------------------------------------------------------------ steps
    def _loss_context(self) -> AbstractContextManager:
        if self._vocab_parallel_head is None:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _run_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        context = getattr(self.precision_plugin, _STEP_CONTEXTS[name])
        with context(), self._loss_context():
            if self._pipeline is not None:
                # the schedule runs backward inside the step: the fp16 loss scale is applied there
                self._pipeline.loss_scale = self.precision_plugin.loss_scale or 1.0
                results = self._pipeline.run(name, *args, *kwargs.values())
                # what the step logged, merged over micro-batches: Lightning's log once per name, on every rank
                return results.log(self.lightning_module.log, self._data_group)
            with _plain_logging(self.lightning_module, self._data_group):
                output = getattr(self.lightning_module, name)(*args, **kwargs)
        return apply_to_collection(output, DTensor, to_plain)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", *args, **kwargs)

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
        # the vocab-parallel cross-entropy's backward must run under the same loss_parallel context as its forward
        with self._loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """DDP's ``no_sync``: Lightning runs the backward passes of gradient-accumulation batches inside this, so they
        only add into the gradient buckets; the step's last backward pass (inside ``optimizer_step``) reduces them."""
        blocked, self._backward_sync_blocked = self._backward_sync_blocked, True
        try:
            yield None
        finally:
            self._backward_sync_blocked = blocked

    @property
    def gradient_buckets(self) -> list[list[dict[str, int]]]:
        """Per optimizer, per gradient bucket (``overlap_grad_reduce``): parameters, bytes, all-reduces started and
        how many of them started during backward (empty lists where the gradients are not bucketed)."""
        return [z.buckets.stats() if z.buckets is not None else [] for z in self._sharded_optimizers]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        sharded = self._sharded_for(optimizer)
        plugin = self.precision_plugin

        def closure_then_reduce() -> Any:
            # order on the gradients the optimizer steps on: reduce, unscale (fp16), agree on overflow world-wide,
            # global norm; Lightning's hooks and clipping follow, then the step (skipped on every rank on overflow)
            buckets = sharded.buckets if sharded is not None else None
            if buckets is not None and not self._backward_sync_blocked:
                buckets.arm()  # this closure's backward pass is the step's last: reduce buckets as it goes
            result = closure()
            self.reduce_gradients(sharded)
            assert self._gradient_norm is not None
            found_inf = plugin.scaler is not None and plugin.unscale_gradients_(
                self._gradient_norm.gradients(), self.root_device
            )
            # one pass over the gradients and a scalar all-reduce: only when asked (clipping takes it anyway)
            tracked = self.track_gradient_norm and not found_inf
            self.last_gradient_norm = self._step_norm = self._gradient_norm.total() if tracked else None
            return result

        try:
            output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        finally:
            self._step_norm = None
        if not self._model_state_settled:
            # sizes settle once every state tensor exists (after the first real step): stop measuring then
            zero = self._sharded_optimizers or None
            measured = measure_model_state_bytes(self.lightning_module, self.optimizers, zero)
            if self._offloads:
                from lightning_hybrid.sharding.offload import offload_ledger

                measured = offload_ledger(measured, self._offloads)
            self._model_state_settled = measured == self.model_state_bytes and not plugin.found_inf
            self.model_state_bytes = measured
        if plugin.found_inf:
            # weights and optimizer state stay as they were; the overflowed gradients go
            if sharded is not None:
                sharded.discard_gradients()
            for p in self.lightning_module.parameters():
                p.grad = None
        elif sharded is not None:
            sharded.gather_parameters()
        return output

    def _hold_schedulers_on_skipped_steps(self, trainer: pl.Trainer) -> None:
        """A step skipped for gradient overflow must not advance per-step LR schedulers (as in Megatron). Lightning
        steps them through the module's ``lr_scheduler_step`` hook after every optimizer step, so the hook is
        wrapped (on this module instance, until teardown) to pass over them after a skipped step."""
        if self.precision_plugin.scaler is None or not trainer.lr_scheduler_configs:
            return
        module = self.lightning_module
        per_step = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        hook = module.lr_scheduler_step
        plugin = self.precision_plugin

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if plugin.found_inf and id(scheduler) in per_step:
                return
            hook(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def _sharded_for(self, optimizer: Any) -> Optional[ShardedOptimizer]:
        raw = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the user's optimizer
        return next((z for z in self._sharded_optimizers if z.optimizer is raw), None)

    def clip_gradients_by_global_norm(self, max_norm: float) -> float:
        """Clip every gradient by the norm over all shards (TP, PP, ZeRO), counting each element once, as on one
        device; returns that norm (before clipping). Collective: all ranks call it (Lightning does, per step)."""
        assert self._gradient_norm is not None, "set up the optimizers first"
        # inside a step the norm was just taken (after the reduction and unscaling): clipping reuses it
        self.last_gradient_norm = self._gradient_norm.clip_(max_norm, norm=self._step_norm)
        return self.last_gradient_norm

    @property
    def pipeline_timeline(self) -> Any:
        """This rank's :class:`~lightning_hybrid.pipeline.runner.StepTimeline` of the last pipeline step (None
        without pipeline parallel): per micro-batch forward/backward timings and the measured bubble fraction."""
        return self._pipeline.timeline if self._pipeline is not None else None

    def reduce_gradients(self, sharded: Optional[ShardedOptimizer] = None) -> None:
        """Make gradients the single-device ones: tensor-parallel replicas first, then data-parallel (ZeRO) reduction.

        Runs once per optimizer step, after all gradient accumulation (FSDP2 reduces ZeRO-3 gradients itself).
        """
        for z in self._sharded_optimizers:
            z.fold_gradients()  # fp32 accumulation of low-precision gradients, before any reduction reads them
        bucketed = sharded is not None and sharded.buckets is not None
        if bucketed:
            # the data-parallel average runs in buckets during backward: let it finish before the tensor-parallel
            # sync reads and writes the same gradients (both are sums over different mesh dimensions, so they
            # commute)
            sharded.reduce_gradients()
        if self._tied_sync is not None:
            self._tied_sync()
        if self._gradient_sync is not None and not (sharded is not None and sharded.reduces_in_backward):
            self._gradient_sync()
        if sharded is not None and not bucketed:
            sharded.reduce_gradients()

    def full_gradients(self) -> dict[str, Tensor]:
        """Every parameter's reduced gradient as a full tensor (gathered over TP and ZeRO shards). Collective: call it
        on all ranks, between the gradient reduction and the optimizer step (e.g. ``on_before_optimizer_step``)."""
        module = self.lightning_module
        grads: dict[int, Optional[Tensor]] = {}
        for z in self._sharded_optimizers:
            grads.update({id(p): g for p, g in zip(z.model_parameters, z.gathered_gradients())})
        out = {}
        for name, p in module.named_parameters():
            g = grads.get(id(p), p.grad)
            if g is None:
                continue
            if isinstance(p, DTensor) and not isinstance(g, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            out[name] = full_tensor(g)  # fused projections too, on every torch of the supported range
        return out

    # ------------------------------------------------------------------ checkpoints
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
        # DTensors stay sharded: every rank saves only its own shards
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        if self._shared is not None:  # entries another pipeline stage owns (and writes) under the same name
            state = {k: v for k, v in state.items() if k not in self._shared.not_owned}
        return _first_replica_buffers(self.lightning_module, state, self._data_group)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # collective under ZeRO-1/2 (each parameter's state is written by one replica): Lightning calls it on all ranks
        raw = getattr(optimizer, "_optimizer", optimizer)
        skip = self._shared.not_owned if self._shared is not None else ()
        return checkpoint_optimizer_state(self.lightning_module, raw, self._sharded_for(raw), skip)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        import lightning

        from lightning_hybrid.checkpoint import HUGGING_FACE_KEY, hugging_face_info

        path = Path(self.broadcast(str(filepath)))
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        checkpoint[LAYOUT_KEY] = self.layout.as_dict()
        # str(): torch.__version__ is a TorchVersion, which meta.pt's weights_only load would refuse
        checkpoint[VERSIONS_KEY] = {"torch": str(torch.__version__), "lightning": lightning.__version__}
        hugging_face = hugging_face_info(self.lightning_module)  # lets `consolidate` write a from_pretrained folder
        if hugging_face is not None:
            checkpoint[HUGGING_FACE_KEY] = hugging_face
        self._checkpoint_writer.save(path, model_state, optimizer_states, checkpoint, is_rank_zero=self.is_global_zero)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint(save_top_k=...) drops an older checkpoint when it starts a newer save: with async saves the
        # deletion waits until the newer one is committed, so a complete checkpoint is always on disk
        if self.is_global_zero:
            self._checkpoint_writer.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        from lightning_hybrid.checkpoint.deepspeed import imported

        self._checkpoint_writer.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        # a DeepSpeed checkpoint is converted to this format first (one process per node), then loaded as usual
        names = list(self.lightning_module.state_dict())
        token = f"{self.broadcast(f'{os.getpid()}-{time.time_ns()}')}-node{self.node_rank}"
        with imported(path, names, converts=self.local_rank == 0, barrier=self.barrier, token=token) as path:
            return self._load_hybrid_checkpoint(path, weights_only)

    def _load_hybrid_checkpoint(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        # ckpt_path="last" goes past a checkpoint that fails its integrity check (the files are then verified)
        path, verified = checkpoint_to_load(path, self.lightning_module.trainer, verify=self._checkpoint_verify)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        tied = self._structure.tied_parameters if self._structure is not None else []
        aliases = {**dict(tied), **{b: a for a, b in tied}}
        meta = load_sharded(
            path,
            self.lightning_module,
            optimizers,
            [self._sharded_for(o) for o in optimizers],
            aliases=aliases,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            verify=self._checkpoint_verify and not verified,
        )
        saved_dp = read_meta(path, weights_only=weights_only).get(LAYOUT_KEY, {}).get("data_parallel_size")
        if saved_dp is not None and saved_dp != self.layout.data_parallel_size:
            rank_zero_warn(
                f"Checkpoint {path} was saved with data_parallel_size={saved_dp}, this run has"
                f" {self.layout.data_parallel_size}: model and optimizer state are resharded exactly; a mid-epoch data"
                " position is restored by skipping the epoch's finished batches, which repeats or skips no sample only"
                " if the global batch (batch_size x data_parallel_size) is the same as when it was saved."
            )
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by load_checkpoint

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        """Leave nothing running: also after an exception (Lightning tears down then too), every step below runs, and
        the first error is raised at the end. Nothing here is collective: after an error, other ranks may not come.
        The process groups themselves are destroyed at exit (see ``setup_environment``)."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self.lightning_module is not None and getattr(self, "_example_input_array", None) is not None:
            self.lightning_module.example_input_array = self._example_input_array
        if self.lightning_module is not None:
            self.lightning_module.__dict__.pop("lr_scheduler_step", None)  # see _hold_schedulers_on_skipped_steps
        # Bucket all-reduces are in flight only if a step raised; they are not waited for here, since the peers may
        # never join them (a wait would then block until the collective timeout instead of letting the job end).
        if self._watchdog is not None:
            self._watchdog.stop()
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
        if self._watchdog is not None:
            self._watchdog.on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="3D parallel: tensor x pipeline x data (ZeRO)")


def _pipeline_network(
    module: pl.LightningModule, structure: ModelStructure, name: Optional[str]
) -> tuple[str, nn.Module, str]:
    """The module whose forward the pipeline stages run (``pipeline_network``, default: the block list's owner), and
    the block list's name relative to it."""
    network_name = name if name is not None else structure.network_name
    try:
        network = module.get_submodule(network_name) if network_name else module
    except AttributeError:
        candidates = [n for n, _ in module.named_modules() if n and structure.blocks_name.startswith(f"{n}.")]
        raise HybridConfigError(
            f"`pipeline_network={network_name!r}` names no submodule of {type(module).__name__}. Give the name of"
            f" the module whose forward runs the block list {structure.blocks_name!r} (one of {candidates or ['']}),"
            " or leave it None to take the block list's owner."
        ) from None
    prefix = f"{network_name}." if network_name else ""
    if not structure.blocks_name.startswith(prefix):
        raise HybridConfigError(
            f"`pipeline_network={network_name!r}` does not contain the block list {structure.blocks_name!r}: give a"
            " module that holds it, or leave `pipeline_network` None."
        )
    return network_name, network, structure.blocks_name[len(prefix) :]


def _destroy_groups_at_exit() -> None:
    """Destroy every process group, then free what they leave behind (work objects, tensors their threads still
    reference) while the interpreter can still run the destructors, instead of during finalization."""
    import gc

    _destroy_dist_connection()
    gc.collect()


def _first_replica_buffers(module: nn.Module, state: dict[str, Any], data_group: Any) -> dict[str, Any]:
    """``state`` with its persistent buffers taken from the first data-parallel replica (collective over the data
    group; the module is not changed). Each replica updates buffers such as BatchNorm's running statistics from its own
    batches; the checkpoint holds one value per key, the first replica's, as Lightning's DDP saves rank 0's."""
    if torch.distributed.get_world_size(data_group) == 1:
        return state
    names = {name for name, _ in module.named_buffers()}
    src = torch.distributed.get_global_rank(data_group, 0)
    out = dict(state)
    for key in sorted(k for k in state if k in names):  # sorted: the same order on every replica
        value = state[key]
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            out[key] = value.detach().clone()
            torch.distributed.broadcast(out[key], src=src, group=data_group)
    return out


def _is_stub(module: nn.Module) -> bool:
    from lightning_hybrid.pipeline.stage import SkippedBlock

    return isinstance(module, SkippedBlock)


@contextmanager
def _plain_logging(module: pl.LightningModule, data_group: Any) -> Generator[None, None, None]:
    """While a step runs, ``self.log`` receives plain tensors (not DTensors) and ``sync_dist`` reduces over the
    data-parallel group only: tensor/pipeline peers hold the same value, so including them would double-count."""
    original = module.log

    @functools.wraps(original)
    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        value = apply_to_collection(value, DTensor, to_plain)
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = data_group
        return original(name, value, *args, **kwargs)

    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
