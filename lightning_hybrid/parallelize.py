"""Model surgery, in the order it happens: plan tensor parallel, cut the pipeline, apply tensor parallel, cast,
activation checkpointing, ZeRO-3 (FSDP2), the pipeline runner, the sums of shared gradients.

:class:`~lightning_hybrid.HybridStrategy` calls :func:`parallelize` once per module, after the mesh exists; what it
needs afterwards comes back as one :class:`Parallelized`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_hybrid._lightning_compat import module_device_mesh, module_trainer
from lightning_hybrid.agreement import computed_on_one_rank, raise_together
from lightning_hybrid.batch_norm import sync_batch_norm
from lightning_hybrid.compile import compile_blocks, compile_needs_blocks
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel import ContextShard, apply_context_parallel, plan_context_parallel
from lightning_hybrid.context_parallel.verify import ContextLossProbe
from lightning_hybrid.expert_parallel import ExpertShards, apply_expert_parallel, find_expert_modules, shard_experts
from lightning_hybrid.layout import ParallelLayout
from lightning_hybrid.pipeline import PipelineRunner, StageModule, partition_blocks, split_network
from lightning_hybrid.pipeline.profile import stage_costs
from lightning_hybrid.pipeline.shared import SharedParameters, find_shared_parameters
from lightning_hybrid.pipeline.stage import InputStub, SkippedBlock
from lightning_hybrid.pipeline.verify import PipelineVerifier, make_verifier
from lightning_hybrid.sharding import GradientSync, apply_fully_shard, check_user_sharding, user_fully_sharded
from lightning_hybrid.structure import ModelStructure, block_list_needed_by, find_model_structure
from lightning_hybrid.tensor_parallel import (
    TensorParallelPlan,
    apply_tensor_parallel,
    build_tensor_parallel_plan,
    sequence_shard_shape,
    validate_tensor_parallel_plan,
)
from lightning_hybrid.tensor_parallel.failures import explain_forward_failure
from lightning_hybrid.tensor_parallel.verify import verified_at_first_call

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_hybrid.precision import HybridPrecision

__all__ = ["ModelOptions", "Parallelized", "parallelize"]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What :func:`parallelize` needs besides the layout: the strategy's model options (defined, with their defaults,
    in ``lightning_hybrid.options.StrategyOptions``) and Lightning's settings.

    Example:
        >>> options = ModelOptions(device=torch.device("cpu"), activation_checkpointing="full",
        ...                        activation_checkpointing_every=1, transformer_blocks=None, compile=False)
    """

    device: torch.device
    """This rank's device."""
    activation_checkpointing: Optional[str]
    """None, ``"full"`` or ``"selective"``: the option's ``checkpoint_mode`` (``activation_checkpointing.py``)."""
    activation_checkpointing_every: int
    transformer_blocks: Optional[str]
    compile: bool
    layer_sync: Any = None
    """``Trainer(sync_batchnorm=True)``'s plugin (SyncBatchNorm over the data-parallel group), or None."""


@dataclass
class Parallelized:
    """What the strategy keeps of a parallelized module."""

    structure: ModelStructure
    """The module's network, block list, input and output modules."""
    gradient_sync: GradientSync
    """The tensor-parallel sum of replicated gradients (and the data average of what ZeRO-3 leaves out)."""
    vocab_parallel_head: Optional[str] = None
    """The output head whose logits stay split over the vocabulary (they reach the step as
    ``tensor_parallel.vocab.VocabParallelLogits``)."""
    runner: Optional[PipelineRunner] = None
    """Runs a step through the pipeline schedule (None without pipeline parallel)."""
    shared: Optional[SharedParameters] = None
    """Parameters several pipeline ranks hold, and which rank owns each (None without pipeline parallel)."""
    tied_sync: Optional[Callable[[], None]] = None
    """Sums the shared parameters' gradients over their holders (None when nothing is shared)."""
    duplicates: list[nn.Parameter] = field(default_factory=list)
    """Shared parameters this rank does not own: counted once in the global norm, on the owner."""
    verifier: Optional[PipelineVerifier] = None
    """The first-batch comparison with an unsplit forward (``verify_pipeline``, or ``verify_tensor_parallel``
    without a pipeline); its ``sync`` is the strategy's."""
    tensor_parallel_plan: Optional[TensorParallelPlan] = None
    """The plan applied (automatic, declared or a dict; None without tensor parallel or when ``configure_model``
    parallelized the module itself)."""
    tensor_parallel_size: int = 1
    experts: Optional[ExpertShards] = None
    """The expert weights split over the expert-parallel ranks, and their mesh (None without expert parallel)."""
    context_probe: Optional[ContextLossProbe] = None
    """Under context parallel without a pipeline, the first step's probe of the user's loss, until it ran (under a
    pipeline the runner holds it; else None)."""

    @property
    def first_step_unchecked(self) -> bool:
        """A first-step check is still to run (``verify_tensor_parallel``, or context parallel's probe)."""
        return self.verifier is not None or self.context_probe is not None

    @contextmanager
    def first_step_checked(self, module: nn.Module, mode: str, args: tuple, kwargs: dict) -> Iterator[None]:
        """The first training step's checks around the step (collective; then off): under context parallel, the
        probe of the step's loss first (context_parallel/verify.py); ``verify_tensor_parallel`` at the step's first
        call of the network, on its arguments (tensor_parallel/verify.py)."""
        verifier, self.verifier = self.verifier, None
        probe, self.context_probe = self.context_probe, None
        if probe is not None:
            probe.check_step(module, mode, args, kwargs)
        if verifier is None:
            yield
            return
        network = module.get_submodule(self.structure.network_name or "")
        with verified_at_first_call(verifier, module, network):
            yield

    @contextmanager
    def explained_failures(self, module: nn.Module) -> Iterator[None]:
        """A step's forward that fails inside a module the tensor-parallel plan splits raises a ``HybridConfigError``
        naming the module and the plan without it (``tensor_parallel/failures.py``); other errors pass unchanged."""
        try:
            yield
        except HybridConfigError:  # the strategy's own finding (a first-step check): said as it is
            raise
        except Exception as error:
            plan = self.tensor_parallel_plan
            explained = None
            if plan is not None:
                explained = explain_forward_failure(error, module, plan, self.tensor_parallel_size)
            if explained is None:
                raise
            raise explained from error


def parallelize(
    module: pl.LightningModule,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ModelOptions,
    precision: HybridPrecision,
    expert_mesh: Optional[DeviceMesh] = None,
    context_mesh: Optional[DeviceMesh] = None,
) -> Parallelized:
    """Split and shard ``module`` in place for ``layout`` on ``mesh``; collective-free where a failure on one rank
    must be raised on all (``raise_together``).

    Order matters: the plan is made and checked on the whole model (so every rank validates the same thing), then
    the pipeline cut removes what this rank does not hold, and tensor parallel, activation checkpointing and ZeRO-3
    apply to what is left.

    Example:
        >>> # parallelized = parallelize(module, strategy.layout, strategy.device_mesh, options, precision_plugin)
        >>> # parallelized.runner.run("training_step", batch, batch_idx)   # under pipeline parallel
    """
    data_group = mesh["data"].get_group()
    # 1. tensor parallel: the plan, on the whole model
    user_parallelized = any(isinstance(p, DTensor) for p in module.parameters())
    tp_options = layout.tensor_parallel
    auto_plan = layout.tensor_parallel_size > 1 and not user_parallelized and tp_options.plan == "auto"
    needed_by = block_list_needed_by(
        pipeline_parallel_size=layout.pipeline_parallel_size,
        activation_checkpointing=options.activation_checkpointing,
        tensor_parallel_auto_plan=auto_plan,
        sequence_parallel=layout.sequence_parallel,
    ) + compile_needs_blocks(options.compile)
    plan = None
    with raise_together():  # planning is collective-free: a failure on any rank is raised on all of them
        sync_batch_norm(module, options.layer_sync, data_group, options.device.type)
        check_user_sharding(module, layout.zero_stage, layout.pipeline_parallel_size)  # its own fully_shard
        # data parallel and ZeRO train any module: only these settings need a block list
        structure = find_model_structure(module, options.transformer_blocks, needed_by)
        if layout.expert_parallel_size > 1:
            _check_experts_dispatchable(module, layout)
        cp = layout.context_parallel_size
        context = plan_context_parallel(module, cp, layout.tensor_parallel_size) if cp > 1 else None
        if layout.tensor_parallel_size > 1 and not user_parallelized:
            plan = build_tensor_parallel_plan(
                module, structure, tp_options.plan, vocab_parallel_loss=tp_options.vocab_parallel_loss
            )
            if layout.expert_parallel_size > 1:  # the experts go to expert ranks, whole on each tensor rank
                plan.without([e.name for e in find_expert_modules(module)[0]])
            validate_tensor_parallel_plan(module, plan, layout.tensor_parallel_size)
    # 2. pipeline parallel: the cut (this rank keeps its stages; the others' blocks become stubs)
    cut = _cut_pipeline(module, structure, layout, mesh, precision) if layout.pipeline_parallel_size > 1 else None
    tp_verifier, context_probe = None, None
    if context is not None:  # before the split: the hooks read what tensor parallel leaves of each head
        context_shard = ContextShard.of(context_mesh["context"].get_group())
        apply_context_parallel(context, context_shard)
        # the user's loss probed at the first step, on the ranks holding the network's output (no copy)
        context_probe = ContextLossProbe(context_shard, structure.network_name or "", precision.precision)
    # verify_tensor_parallel: the unsplit copy is taken before the split
    if cut is None and plan is not None and context is None:
        network = module.get_submodule(structure.network_name) if structure.network_name else module
        tp_verifier = make_verifier(
            tp_options.verify_tensor_parallel, module, network, mesh, precision=precision.precision, last_stage_rank=0,
            option="verify_tensor_parallel", shared=_attached_to(module),
        )  # fmt: skip
    # 3. tensor parallel: applied to what this rank holds
    replicated, vocab_head = _apply_tensor_parallel(module, structure, plan, layout, mesh, user_parallelized, cut)
    held_blocks = [n for n in structure.block_names() if not isinstance(module.get_submodule(n), SkippedBlock)]
    # 3b. expert parallel: the experts this rank holds, split over the expert-parallel ranks
    experts = _apply_expert_parallel(module, expert_mesh) if expert_mesh is not None else None
    _cast(module, layout, precision)
    if cut is not None and precision.master_dtype is not None:
        # the meta copy that sizes the stage boundaries computes in the dtype the cast module now does
        cut[0].cast_unsplit(precision.compute_dtype, buffers=layout.zero_stage < 3)
    # 4. activation checkpointing
    if options.activation_checkpointing:
        from lightning_hybrid.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(
            module, structure.block_names(), options.activation_checkpointing,
            every=options.activation_checkpointing_every, held=held_blocks,
        )  # fmt: skip
    # 4b. compile each block, after tensor parallel and checkpointing, before ZeRO-3 wraps it (as torchtitan does)
    if options.compile:
        compile_blocks(module, held_blocks)
    # 5. ZeRO-3: FSDP2 (ZeRO-1/2 wrap the optimizers instead: sharding/gradient_step.py)
    dp_replicated = _fully_shard(module, structure, layout, mesh, precision, held_blocks, cut, experts)
    # 6. the pipeline runner, and the sums of parameters several stages hold
    runner, shared, verifier = None, None, tp_verifier
    if cut is not None:
        split, network, verifier = cut
        runner = _build_runner(module, network, split, layout, mesh, precision, options.device)
        # collective at set-up: every rank calls it
        shared = find_shared_parameters(module, split, structure.tied_parameters, mesh)
        if verifier is not None:  # within a replica: tensor-parallel and shared-parameter sums
            verifier.duplicates = lambda: shared.duplicates
            runner.verifier = verifier
        runner.context_probe, context_probe = context_probe, None
        if layout.zero_stage == 3:
            dp_replicated += shared.loose  # in no stage's FSDP2 root: averaged over data like those left out
    if verifier is not None and precision.master_dtype is None:
        # the weights the copy was taken with (not so after a '-true' cast), to see at the first step if they changed
        verifier.remember(network)
    return Parallelized(
        structure=structure,
        gradient_sync=GradientSync(module, replicated, mesh["tensor"], dp_replicated, mesh["data"]),
        vocab_parallel_head=vocab_head,
        runner=runner,
        shared=shared,
        tied_sync=shared.sync if shared is not None and shared.groups else None,
        duplicates=shared.duplicates if shared is not None else [],
        verifier=verifier,
        tensor_parallel_plan=plan,
        tensor_parallel_size=layout.tensor_parallel_size,
        experts=experts,
        context_probe=context_probe,
    )


def _check_experts_dispatchable(module: nn.Module, layout: ParallelLayout) -> None:
    """Refuse, on the whole model (every rank plans the same, whichever pipeline stage it will hold), what expert
    parallel cannot split."""
    ep = layout.expert_parallel_size
    experts, refused = find_expert_modules(module)
    if refused:
        named = "; ".join(f"{name!r}: {why}" for name, why in refused.items())
        raise HybridConfigError(
            f"`expert_parallel_size={ep}` cannot dispatch these MoE layers: {named}. Expert parallel needs"
            " experts modules of the form transformers 5 ships (packed expert weights and a forward taking"
            " (hidden_states, top_k_index, top_k_weights)); use `expert_parallel_size=1`, or split the experts"
            " over the tensor-parallel ranks (docs/expert-parallel.md)."
        )
    if not experts:
        raise HybridConfigError(
            f"`expert_parallel_size={ep}`, but {type(module).__name__} has no mixture-of-experts layer to split"
            " (no experts module with packed expert weights). Use `expert_parallel_size=1`."
        )
    uneven = [f"{e.name!r} ({e.num_experts})" for e in experts if e.num_experts % ep]
    if uneven:
        raise HybridConfigError(
            f"`expert_parallel_size={ep}` does not divide the number of experts of {', '.join(uneven)}. Choose an"
            " expert_parallel_size that divides every MoE layer's expert count."
        )


def _apply_expert_parallel(module: nn.Module, expert_mesh: DeviceMesh) -> ExpertShards:
    """Split the experts modules this rank holds (a pipeline stage may hold none) over the expert-parallel ranks."""
    experts, _ = find_expert_modules(module)
    return apply_expert_parallel(module, experts, expert_mesh)


def _apply_tensor_parallel(
    module: nn.Module,
    structure: ModelStructure,
    plan: Optional[TensorParallelPlan],
    layout: ParallelLayout,
    mesh: DeviceMesh,
    user_parallelized: bool,
    cut: Any,
) -> tuple[list[tuple[str, str]], Optional[str]]:
    """Shard the layers; returns the parameters left replicated over the tensor dimension with their reduction, and
    the vocab-parallel head."""
    if plan is not None:
        if cut is not None:
            plan.restrict_to(module)
        pairs = apply_tensor_parallel(
            module, structure, plan, mesh["tensor"], sequence_parallel=layout.sequence_parallel
        )
        named = {id(p): n for n, p in module.named_parameters()}
        rank_zero_info("lightning-hybrid tensor-parallel plan:\n" + plan.describe())
        return [(named[id(p)], op) for p, op in pairs], plan.vocab_parallel_head
    if user_parallelized and layout.tensor_parallel_size > 1:
        if layout.sequence_parallel:
            raise HybridConfigError(
                "`sequence_parallel=True` is applied with the automatic/dict plan, but `configure_model` already"
                " parallelized the model. Add SequenceParallel styles to your own plan and leave"
                " `sequence_parallel=False`."
            )
        return [(n, "avg") for n, p in module.named_parameters() if not isinstance(p, DTensor)], None
    return [], None


def _attached_to(module: nn.Module) -> tuple[Any, ...]:
    """What a LightningModule is attached to (its trainer and mesh): an unsplit copy of its network shares them."""
    return module_trainer(module), module_device_mesh(module)


def _cast(module: nn.Module, layout: ParallelLayout, precision: HybridPrecision) -> None:
    if layout.zero_stage < 3:
        # '-true' precisions: low-precision parameters (the optimizer keeps fp32 masters); ZeRO-3 instead keeps
        # fp32 shards as the masters and lets FSDP2 cast them for compute (its MixedPrecisionPolicy)
        precision.convert_module(module)
    if precision.master_dtype is not None:
        # stand-ins for other stages' input modules must produce what those modules now compute in
        for stub in module.modules():
            if isinstance(stub, InputStub) and stub.dtype.is_floating_point:
                stub.dtype = precision.compute_dtype


def _fully_shard(
    module: nn.Module,
    structure: ModelStructure,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    precision: HybridPrecision,
    held_blocks: list[str],
    cut: Any,
    experts: Optional[ExpertShards],
) -> list[str]:
    """ZeRO-3; returns the parameters FSDP2 leaves out (replicated over data)."""
    if layout.zero_stage != 3:
        return []
    # fully_shard is collective-free at set-up, and what it leaves out depends on the stage a rank holds
    with raise_together():
        # each pipeline stage module becomes the FSDP2 root of its own parameters (_build_runner)
        roots = structure.fully_shard_roots(module) if cut is None else None
        kwargs = _fsdp_kwargs(layout, precision)
        user_sharded = user_fully_sharded(module)  # asked before the experts' units exist
        if experts is not None and not user_sharded:
            shard_experts(experts, **kwargs)  # units of their own, inside their blocks' units
        dp_replicated = apply_fully_shard(module, held_blocks, roots, mesh["data"], user_sharded=user_sharded, **kwargs)
        if dp_replicated and precision.master_dtype is not None:
            raise HybridConfigError(
                f"`precision={precision.precision!r}` with `zero_stage=3` cannot hold"
                f" {dp_replicated}: FSDP2 leaves them out (fused tensor-parallel biases, or parameters the"
                " LightningModule holds itself), so nothing casts them. Use zero_stage=1 or 2 with this"
                " precision, a '-mixed' precision with zero_stage=3, or move such parameters into a submodule."
            )
    return dp_replicated


def _fsdp_kwargs(layout: ParallelLayout, precision: HybridPrecision) -> dict[str, Any]:
    """FSDP2 arguments for ZeRO-3: under '-true' precisions the fp32 shards are the master weights, cast to the
    low precision for compute, with gradients reduced and accumulated in fp32. Under pipeline parallel the
    parameters stay gathered from forward to backward (as torchtitan does): otherwise every micro-batch's
    backward gathers them again, nearly doubling the data-parallel traffic."""
    kwargs: dict[str, Any] = {}
    if layout.pipeline_parallel_size > 1:
        kwargs["reshard_after_forward"] = False
    if precision.master_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=precision.compute_dtype, reduce_dtype=precision.master_dtype
        )
    return kwargs


def _cut_pipeline(
    module: pl.LightningModule,
    structure: ModelStructure,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    precision: HybridPrecision,
) -> tuple[Any, nn.Module, Optional[PipelineVerifier]]:
    """Cut the network into stages; returns the split, the network the stages run, and the verifier (made before
    the cut: its reference rank copies the whole network)."""
    options = layout.pipeline
    with raise_together():
        _, network, blocks_rel = _pipeline_network(module, structure, options.network)
    partition = options.partition
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
            options.virtual_pipeline_size,
            partition,
            block_costs=costs,
            first_cost=first_cost,
            last_cost=last_cost,
            owner_style="v" if options.schedule == "zbv_zero_bubble" else "loop",
        )
        # each stage's parameters (one device's count, read before the cut leaves this rank its own stages only),
        # whatever the partition; a profiled one adds its seconds
        params = stage_plan.stage_sums(*(stage_costs(network, blocks_rel, "parameters") if partition != "parameters"
                                         else (costs, first_cost, last_cost)))  # fmt: skip
        seconds = stage_plan.costs if partition == "profile" else ()
        pipeline_rank = mesh["pipeline"].get_local_rank()
        verifier = make_verifier(  # not under context parallel: the copy runs on one rank, attention needs them all
            options.verify_pipeline if layout.context_parallel_size == 1 else False,
            module,
            network,
            mesh,
            precision=precision.precision,
            last_stage_rank=stage_plan.owner[-1],
            shared=_attached_to(module),
        )
        # the network may be the LightningModule: its meta copy refers to the same Trainer and mesh
        keep = (module_trainer(module), module_device_mesh(module))
        split = split_network(network, blocks_rel, stage_plan, pipeline_rank, root=module, keep=keep)
    rank_zero_info("lightning-hybrid pipeline stages:\n" + stage_plan.format_table(params, seconds))
    return split, network, verifier


def _build_runner(
    module: pl.LightningModule,
    network: nn.Module,
    split: Any,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    precision: HybridPrecision,
    device: torch.device,
) -> PipelineRunner:
    tp = layout.tensor_parallel_size

    def activation_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        # with sequence parallel, what crosses stages is this rank's slice of the sequence
        return sequence_shard_shape(shape, tp) if layout.sequence_parallel else shape

    def wrap_stage(stage: StageModule) -> StageModule:
        if layout.zero_stage != 3:
            return stage
        from torch.distributed.fsdp import fully_shard

        kwargs = _fsdp_kwargs(layout, precision)
        if layout.zero.zero3_gradient_sync == "per_step":
            # the stage module is the FSDP2 root: torch's PipelineStage then accumulates unsharded gradients
            # over micro-batches and reduce-scatters once per step
            fully_shard(stage, mesh=mesh["data"], **kwargs)
        else:
            # every block (and each input/output module) is its own FSDP2 root, which reduce-scatters its
            # gradients and frees the unsharded ones after each micro-batch's backward
            for part in stage.parts:
                if not isinstance(part, FSDPModule):
                    fully_shard(part, mesh=mesh["data"], **kwargs)
        return stage

    return PipelineRunner(
        module,
        network,
        split,
        mesh["pipeline"],
        device,
        schedule=layout.pipeline.schedule,
        num_microbatches=layout.pipeline.num_microbatches,
        activation_shape=activation_shape,
        wrap_stage=wrap_stage,
    )


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
