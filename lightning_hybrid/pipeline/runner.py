"""Running a LightningModule's step through a pipeline schedule.

One step: split the batch into micro-batches; on every rank, run the user's step until it calls the network, to learn
the network's inputs per micro-batch (cheap: nothing is computed); run torch's schedule over this rank's stages; on
the last stage, each micro-batch runs the rest of the user's step (loss, ``self.log``) on the stage's output; the
step's loss and logged values are then sent to every stage, so Lightning, callbacks and loggers see the real values
on every rank and nothing waits for a rank that never logs.

The step is data (pipeline/step_data.py): a :class:`StepContext` handed to each stage module for the schedule's run, and
a :class:`StepResults` the strategy logs once. The per-step and per-micro-batch work here is on the host's critical
path (a pipeline step is many short actions): what the user's step logs is collected per micro-batch without
Lightning's ``self.log`` (pipeline/logged.py), and travels as one small tensor once the logged names are known
(``_share_results``); the stage swaps are built once (``NetworkSplit.active``); only the micro-batches a rank's
stages use are captured, under one hook per step; and the received activation goes through an autograd function
only where the schedule takes input gradients from ``torch.autograd.grad`` (``NetworkSplit.attached``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import (
    capture_call,
    capture_calls,
    first_tensor,
    forward_replaced,
    tensors_in,
)
from lightning_hybrid._torch_compat import module_parameters
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.monitoring.metrics import MetricMirror
from lightning_hybrid.pipeline.boundaries import TensorSpec, UnsplitForward, trace_unsplit_forward
from lightning_hybrid.pipeline.logged import LogCollector, log_dtype, merge_records, scalar_means
from lightning_hybrid.pipeline.microbatch import batch_size_of, merge_microbatches, split_batch
from lightning_hybrid.pipeline.stage import NetworkSplit, StageBoundary, StageModule
from lightning_hybrid.pipeline.step_data import (
    ActionTimer,
    StepContext,
    StepResults,
    StepTimeline,
    TimedStage,
)
from lightning_hybrid.pipeline.verify import FirstStepChecks, PipelineVerifier
from lightning_hybrid.pipeline_schedules import MULTI_STAGE, SCHEDULES, SPLIT_BACKWARD

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SCHEDULES", "PipelineRunner", "StepResults", "StepTimeline"]


class PipelineRunner:
    """Runs training/validation/test/predict steps of ``module`` through the pipeline schedule on this rank."""

    def __init__(
        self,
        module: nn.Module,
        network: nn.Module,
        split: NetworkSplit,
        pp_mesh: DeviceMesh,
        device: torch.device,
        *,
        schedule: str,
        num_microbatches: int,
        activation_shape: Callable[[tuple[int, ...]], tuple[int, ...]],
        wrap_stage: Callable[[StageModule], StageModule] = lambda m: m,
    ) -> None:
        self.module, self.network, self.split = module, network, split
        self.pp_mesh, self.device = pp_mesh, device
        self.schedule_name, self.num_microbatches = schedule, num_microbatches
        self.activation_shape = activation_shape
        self._network_forward = network.forward
        self.stages = {s: wrap_stage(StageModule(s, split.stage_modules(s))) for s in split.local_stages()}
        self.last_stage = split.num_stages - 1
        # the last stage reruns the user's step: it needs the captured inputs of micro-batch 0 only (schedule key)
        self._capture_all = any(s != self.last_stage for s in self.stages)
        self._split_backward = schedule in SPLIT_BACKWARD
        self._cache: dict[tuple, tuple[Any, dict[int, Tensor], Optional[UnsplitForward]]] = {}
        self._param_tables: Optional[list[dict[str, Optional[nn.Parameter]]]] = None
        self._schema: Optional[list[tuple[str, tuple, dict]]] = None
        """Names, args and kwargs of the last training step's logged records when all were scalars: the next step's
        records then travel as one tensor. The same on every rank (learned from the object broadcast)."""
        self._stashed: list[tuple[nn.Parameter, Tensor]] = []
        self._timer = ActionTimer(dist.get_rank())
        self._log = LogCollector()
        self._metrics = MetricMirror(module)
        """The module's torchmetrics objects, updated on the last stage and mirrored on the others."""
        self.verifier: Optional[PipelineVerifier] = None
        """``verify_pipeline``: compares the first batch with an unsplit forward (the strategy sets it)."""
        self.explain_step_failure: Optional[Callable[[BaseException], Optional[Exception]]] = None  # parallelize
        self.context_probe: Any = None  # context parallel's first-step probe of the loss (context_parallel/verify.py)
        self._probe_output: Any = None  # micro-batch 0's network output on the last stage, for the probe
        self._checks_pending = True
        self.verification: Optional[dict[str, float]] = None
        """On the rank that ran ``verify_pipeline``'s comparison: the values it compared."""
        self._sends: dict[int, Tensor] = {}
        """Per stage of this rank but the last: an example of what it sends (shape and dtype), for the schedule's
        current network inputs."""
        self._differentiated: Optional[frozenset[str]] = None
        """The parameters one device's forward differentiates on those inputs (None: not known)."""
        self._sending: Optional[tuple[Any, Tensor]] = None
        """The last stage's broadcast of the previous step's results, still in flight (work, buffer)."""
        self._receiving: Optional[tuple[Any, Tensor]] = None
        """This step's results broadcast, received early on the first stage's rank (see ``_receive_early``)."""
        # gloo runs an asynchronous collective on its own thread, apart from the point-to-point transfers, so the
        # first stage's rank can post its receive of the step's results before its last action (NCCL orders a
        # communicator's operations as issued: there the receive is posted after the schedule, as the peers' are)
        self._receive_early = (
            0 in self.stages
            and self.last_stage not in self.stages
            and (dist.get_backend(pp_mesh.get_group()) == "gloo")
        )
        last_rank = split.plan.owner[self.last_stage]
        self._last_global_rank = dist.get_global_rank(pp_mesh.get_group(), last_rank)

    # ------------------------------------------------------------------ public
    @property
    def timeline(self) -> StepTimeline:
        """This rank's compute actions of the last step."""
        return self._timer.timeline

    def run(self, mode: str, batch: Any, *extra: Any, loss_scale: float = 1.0) -> StepResults:
        """Run ``mode`` (``"training_step"``, ``"validation_step"``, ...) for one batch on this rank's stages; the
        step's loss or outputs and logged values, the same on every rank (log them with :meth:`StepResults.log`).
        ``loss_scale`` multiplies the loss the schedule differentiates (the fp16 loss scale over Lightning's
        ``accumulate_grad_batches``)."""
        self.finish_sending()
        training = mode == "training_step"
        size = batch_size_of(batch)
        m = self.num_microbatches if training else _largest_divisor(size or 1, self.num_microbatches)
        microbatches = split_batch(batch, m)
        with self._log.installed(self.module):
            used = microbatches if self._capture_all else microbatches[:1]
            step = StepContext(mode, microbatches, extra, self._capture(mode, used, extra), self._run_stage)
            step.records, step.loss_scale = [[] for _ in range(m)], loss_scale
            schedule = self._schedule(training, m, step.captured[0])
            previous = self._take_gradients() if training else []
            checks_done = not self._checks_pending
            if training and self._checks_pending:
                # the first training step checks the cut before any optimizer step; verify_pipeline does it in a step
                # of its own, otherwise this step carries the checks
                self._checks_pending = False
                step.checks = FirstStepChecks(self.network, self.split, differentiated=self._differentiated)
                if self.verifier is not None:
                    self._verify(step, schedule)
                    step.checks = None
            self._timer.begin(self._early_receive(m) if training and checks_done else None)
            last = self.last_stage in self.stages
            if last:
                self._metrics.begin()
            try:
                self._execute(step, schedule, training)
            finally:
                if last:
                    step.metrics = self._metrics.end()
            self._timer.end()
        if training:
            if step.checks is not None:
                step.checks.check_gradients(self.stages)
                step.checks.raise_together()
                if self.context_probe is not None:  # collective over the world: every rank, before any optimizer step
                    output, self._probe_output = self._probe_output, None
                    with self._metrics.unchanged():
                        self.context_probe.check_output(self.module, mode, step.microbatches[0], step.extra, output)
            self._stashed = self._take_gradients()
            for p, g in previous:  # back in place, for Lightning's zero_grad to clear or gradient accumulation to keep
                p.grad = g
        return self._share_results(step, training)

    def finish_sending(self) -> None:
        """Wait for the last stage's broadcast of the previous step's results to leave (a no-op elsewhere); the next
        step calls it. Teardown does not: after an error a peer may never receive it, and teardown waits on no
        collective."""
        if self._sending is not None:
            work, _ = self._sending
            self._sending = None
            work.wait()

    def restore_gradients(self) -> None:
        """Give back the gradients the schedule produced (see ``_take_gradients``), adding to any already there."""
        for p, g in self._stashed:
            p.grad = g if p.grad is None else p.grad + g
        self._stashed = []

    def _execute(self, step: StepContext, schedule: Any, training: bool) -> None:
        """One run of the schedule over ``step``'s micro-batches on this rank's stages, which read ``step``."""
        ids = torch.arange(len(step.microbatches), device=self.device)
        args = (ids,) if 0 in self.stages else ()
        last = self.last_stage in self.stages
        kwargs: dict[str, Any] = {"target": ids, "losses": []} if last and training else {}
        step.counters = {s: 0 for s in self.stages}
        for module in self.stages.values():
            module.context = step
        try:
            with self.split.attached(step, self._split_backward), nullcontext() if training else torch.no_grad():
                schedule.step(*args, **kwargs)
        finally:
            for module in self.stages.values():
                module.context = None

    def _verify(self, first: StepContext, schedule: Any) -> None:
        """``verify_pipeline``: a pipeline step in which only micro-batch 0 (the first replica's, on every replica)
        counts, checked structurally, then its loss and gradient norm against the unsplit copy on one rank. The
        gradients it makes are dropped; the real step follows unchanged."""
        verifier = self.verifier
        assert verifier is not None and first.checks is not None
        self.verifier = None
        m = len(first.microbatches)
        verifier.refresh(self.network)
        microbatch = verifier.common_microbatch(first.microbatches[0])
        # captured once per micro-batch: the network's inputs may carry a graph of modules outside it (torch's
        # nn.TransformerEncoder takes the embedding's output), which each micro-batch's backward goes through
        captured = self._capture(first.mode, [microbatch] * (m if self._capture_all else 1), first.extra)
        step = StepContext(first.mode, [microbatch] * m, first.extra, captured, self._run_stage)
        step.records, step.weights, step.checks = [[] for _ in range(m)], [1.0] + [0.0] * (m - 1), first.checks
        # the check's runs of the user's step must not count in its torchmetrics objects
        with verifier.deterministic(self.module, verifier.reference), self._metrics.unchanged():
            self._execute(step, schedule, True)
            step.checks.check_gradients(self.stages)
            step.checks.raise_together()
            norm = verifier.gradient_norm(self.module)
            for p in self.module.parameters():
                p.grad = None
            reference = None
            if verifier.reference is not None:
                verifier.reference.to(self.device)  # copied at set-up, before the model moved to its device
                verifier.measured = (float(step.losses[0]), norm)

                def run_step(forward: Callable) -> Tensor:
                    with forward_replaced(self.network, forward):
                        out = getattr(self.module, step.mode)(microbatch, *step.extra)
                    out = apply_to_collection(out, DTensor, to_plain)
                    return out if isinstance(out, Tensor) else out["loss"]

                reference = verifier.reference_values(run_step, self.module, self.network)
            verifier.compare(reference)
        self.verification = verifier.result

    # ------------------------------------------------------------------ capture and stage execution
    def _capture(self, mode: str, microbatches: list[Any], extra: tuple) -> list[tuple[tuple, dict]]:
        """The network's arguments in the user's step for each of ``microbatches`` (the step stops at the network's
        call)."""
        step = getattr(self.module, mode)
        captured = capture_calls(self.network, [partial(step, mb, *extra) for mb in microbatches])
        if any(c is None for c in captured):
            raise HybridConfigError(
                f"Under pipeline parallel, `{mode}` must call the network ({type(self.network).__name__}) once; it"
                " did not. If another module is the network, pass `HybridStrategy(pipeline_network='<its name>')`;"
                " if the step calls no network at all, it cannot be pipelined."
            )
        return captured  # type: ignore[return-value]

    def _run_stage(self, step: StepContext, stage: int, x: Tensor) -> Any:
        """A stage module's forward for the next micro-batch of ``step`` (torch's schedule calls it)."""
        mb = step.counters[stage]
        step.counters[stage] += 1
        received = None if stage == 0 else x
        checks = step.checks
        if checks is None:
            return self._stage_forward(step, stage, mb, received)
        checks.begin()
        try:
            out = self._stage_forward(step, stage, mb, received)
        except Exception as error:
            # the first step: record it and go on with a stand-in, so the schedule's peers are not left waiting;
            # every rank raises it after the step (FirstStepChecks.raise_together)
            explained = self.explain_step_failure(error) if self.explain_step_failure is not None else None
            checks.failed(stage, explained or error, in_the_step=explained is not None)
            out = self._stand_in(stage, received)
            if stage == self.last_stage and step.mode == "training_step":
                step.losses.append(out.detach().reshape(()))
            return out
        if mb == 0 and isinstance(out, Tensor):
            checks.check_output(stage, received, out, stage == self.last_stage)
        return out

    def _stand_in(self, stage: int, received: Optional[Tensor]) -> Tensor:
        """What a stage that failed at the first step hands on: zeros of its output's shape, in autograd."""
        base = torch.zeros(1, device=self.device) if stage == self.last_stage else torch.zeros_like(self._sends[stage])
        return base + received.sum() * 0 if received is not None else base.requires_grad_()

    def _stage_forward(self, step: StepContext, stage: int, mb: int, received: Optional[Tensor]) -> Any:
        if stage != self.last_stage:
            args, kwargs = step.captured[mb]
            return self._sendable(stage, self._partial_forward(step, stage, received, args, kwargs))

        def network_call(*args: Any, **kwargs: Any) -> Any:
            out = self._partial_forward(step, stage, received, args, kwargs)
            if step.checks is not None and mb == 0:
                step.checks.check_network_output(out)
                if self.context_probe is not None:
                    self._probe_output = out
            return out

        self._log.sink = step.records[mb]
        try:
            with forward_replaced(self.network, network_call):
                out = getattr(self.module, step.mode)(step.microbatches[mb], *step.extra)
        finally:
            self._log.sink = None
        if isinstance(out, DTensor) or not isinstance(out, Tensor):
            out = apply_to_collection(out, DTensor, to_plain)
        if step.mode != "training_step":
            step.outputs.append(apply_to_collection(out, Tensor, lambda t: t.detach()))
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        loss = out if isinstance(out, Tensor) else out["loss"]
        step.losses.append(loss.detach())
        # the micro-batch mean gives the full batch's mean-loss gradient, as on one device
        # shape [1], not a scalar: schedules concatenate last-stage outputs across micro-batches
        # in fp32: a scaled fp16 loss would overflow fp16 (4.0 x 2**16 > 65504)
        weight = step.weights[mb] if step.weights is not None else step.loss_scale / len(step.microbatches)
        return (loss.float() * weight).reshape(1)

    def _partial_forward(
        self, step: StepContext, stage: int, received: Optional[Tensor], args: tuple, kwargs: dict
    ) -> Any:
        """The network's forward on ``args`` restricted to ``stage`` (the split's swaps, and its hooks reading
        ``step.active``): the stage's output activation, or the network's output on the last stage."""
        step.active = (stage, received)
        try:
            with self.split.active(stage):
                return self._network_forward(*args, **kwargs)
        except StageBoundary as boundary:
            return boundary.output
        finally:
            step.active = None

    def _sendable(self, stage: int, out: Any) -> Any:
        """``stage``'s output as its boundary sends it: of the shape and dtype the boundary was sized with (else
        refused), and contiguous (c10d sends a contiguous buffer: a block may return a view, such as a channels-last
        permute of its input; the copy costs one activation per micro-batch where it is one, nothing otherwise)."""
        expected = self._sends[stage]
        if not isinstance(out, Tensor) or out.shape != expected.shape or out.dtype != expected.dtype:
            if isinstance(out, Tensor) and out.shape == expected.shape:
                got, carried = str(out.dtype), str(expected.dtype)  # a dtype the boundary was not sized with
            else:
                got = str(list(out.shape)) if isinstance(out, Tensor) else type(out).__name__
                carried = str(list(expected.shape))
            last = f"{self.split.blocks_name}.{self.split.plan.blocks(stage).stop - 1}"
            why = (
                " The network's forward could not run on meta tensors to show the shape and dtype at each boundary,"
                " so each was sized as the hidden state entering the first block: this block list changes it."
                if self._differentiated is None
                else ""
            )
            raise HybridConfigError(
                f"pipeline stage {stage} ends with `{last}`, whose output ({got}) is not the {carried} the stage"
                f" boundary carries.{why} Give `pipeline_partition` as a list of block counts that ends stages only"
                " where the hidden state has the shape and dtype entering the first block, or train without pipeline"
                " parallel (`pipeline_parallel_size=1`)."
            )
        return out.contiguous()

    # ------------------------------------------------------------------ schedules
    def _first_block_input(self, captured: tuple[tuple, dict]) -> Tensor:
        """The hidden state entering the block list, from a forward that stops at its entrance (stubs make it cheap
        off the first stage): its dtype is the boundaries' (after a '-true' cast, which the meta copy missed)."""
        stage = min(self.stages)
        # the probe calls the network directly, not through the stage module: gather ZeRO-3 input modules by hand
        fsdp = [m for m in self.stages.values() if hasattr(m, "unshard") and hasattr(m, "reshard")]
        for m in fsdp:
            m.unshard()
        try:
            # off the first stage the input modules are already stubs (split_network): nothing to switch
            with torch.no_grad(), self.split.active(stage) if stage == 0 else nullcontext():
                entry = capture_call(self.split.blocks[0], lambda: self._network_forward(*captured[0], **captured[1]))
        finally:
            for m in fsdp:
                m.reshard()
        found = first_tensor(*entry) if entry is not None else None
        if found is None:
            raise HybridConfigError("Could not find the hidden state entering the block list for pipeline parallel.")
        return found[1]

    def _boundaries(self, captured: tuple[tuple, dict]) -> tuple[list[Tensor], Optional[UnsplitForward]]:
        """Zeros of the shape and dtype each stage receives (torch's stages size their buffers by them), from a
        forward of the unsplit network's meta copy under the step's autocast (pipeline/boundaries.py; blocks may
        change the shape and the dtype), and that forward. Where it cannot run: every boundary sized as the hidden
        state entering the first block, and None."""
        hidden = self._first_block_input(captured)
        split = self.split
        trace = None
        if split.unsplit is not None:
            trace = trace_unsplit_forward(
                split.unsplit, split.blocks_name, *captured, training=self.network.training,
                inputs=split.input_names, device=self.device,
            )  # fmt: skip
        if trace is None:
            specs = [TensorSpec(tuple(hidden.shape), hidden.dtype)] * split.num_stages
        else:
            specs = trace.stage_inputs(split.plan, split.blocks_name)
        examples = [torch.zeros(self.activation_shape(s.shape), dtype=s.dtype, device=self.device) for s in specs]
        return examples, trace

    def _schedule(self, training: bool, m: int, captured: tuple[tuple, dict]) -> Any:
        # keyed by the network inputs' shapes, so the boundaries are found again only when they change
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors_in(captured))
        key = (training, m, shapes, torch.is_autocast_enabled(self.device.type))
        if key in self._cache:
            schedule, self._sends, trace = self._cache[key]
            self._differentiated = trace.used if trace is not None else None
            self.split.learn(trace)  # what the stand-ins for other stages' blocks return, for these inputs
            return schedule
        entering, trace = self._boundaries(captured)
        self._differentiated = trace.used if trace is not None else None
        self.split.learn(trace)
        self._sends = {s: entering[s + 1] for s in self.stages if s != self.last_stage}
        from torch.distributed import pipelining

        group = self.pp_mesh.get_group()
        stages = []
        # the last stage's output: the micro-batch loss, shape [1]
        entering.append(torch.zeros(1, dtype=torch.float32, device=self.device))
        for s, module in sorted(self.stages.items()):
            # example tensors' requires_grad tells the stage which gradients cross stage borders
            ids = torch.zeros(1, dtype=torch.long, device=self.device)
            inputs = ids if s == 0 else entering[s].detach().clone().requires_grad_(training)
            outputs = entering[s + 1].detach().clone().requires_grad_(training)
            stages.append(TimedStage(module, s, self.split.num_stages, self.device, input_args=inputs,
                                     output_args=outputs, group=group, timer=self._timer))  # fmt: skip
        name = self.schedule_name
        if not training and name not in MULTI_STAGE:
            # forward only, every single-stage schedule runs the forwards in the same order; GPipe has no lower bound
            # on the micro-batches (1F1B wants one per stage), which an evaluation's last, smaller batch may not give
            name = "gpipe"
        cls = getattr(pipelining, SCHEDULES[name])
        loss_fn = (lambda output, target: output.sum()) if training else None
        if name in MULTI_STAGE:
            schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = cls(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        self._cache[key] = (schedule, self._sends, trace)
        return schedule

    # ------------------------------------------------------------------ results
    def _take_gradients(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Move gradients off the parameters. Lightning's loop calls ``zero_grad`` between ``training_step`` and
        ``backward``, but the schedule runs the backward inside the step: the step's gradients are held aside until
        ``backward`` (``restore_gradients``), and gradients from before the step are kept out of the schedule's
        accumulation (FSDP2 and autograd both add to an existing ``.grad``)."""
        tables = self._param_tables
        if tables is None:  # walking the module tree twice a step cost more than the moves
            tables = self._param_tables = [t for t in map(module_parameters, self.module.modules()) if t]
        # what is registered now, as parameters() gives: FSDP2 swaps its (un)sharded tensors in
        taken = [(p, g) for table in tables for p in table.values() if p is not None and (g := p.grad) is not None]
        if len({id(p) for p, _ in taken}) < len(taken):  # tied weights: once, where first registered
            unique: dict[int, tuple[nn.Parameter, Tensor]] = {}
            for p, g in taken:
                unique.setdefault(id(p), (p, g))
            taken = list(unique.values())
        for p, _ in taken:
            p.grad = None
        return taken

    def _early_receive(self, m: int) -> Optional[tuple[int, Callable[[], None]]]:
        """On the first stage's rank (gloo): post the receive of the step's results as this rank's last action of
        the step starts, so the broadcast's latency passes behind that action rather than after the schedule. The
        count is this rank's actions in a training step: a forward and a backward per micro-batch and stage (and a
        weight backward under zero-bubble schedules)."""
        if not self._receive_early or self._schema is None:
            return None
        actions = m * len(self.stages) * (3 if self._split_backward else 2)
        buffer = torch.empty(2 + len(self._schema), dtype=torch.float64, device=self.device)

        def post() -> None:
            work = dist.broadcast(buffer, src=self._last_global_rank, group=self.pp_mesh.get_group(), async_op=True)
            self._receiving = (work, buffer)

        return actions, post

    def _share_results(self, step: StepContext, training: bool) -> StepResults:
        """The step's loss or outputs and its logged values (merged over micro-batches), from the last stage to
        every rank of the pipeline group in one broadcast."""
        group = self.pp_mesh.get_group()
        last = self.last_stage in self.stages
        if training and self._schema is not None:
            # one tensor broadcast: [schema matches, loss, logged means...]; a 0 flag sends everyone to the object
            # path below, so every rank takes the same path
            k = len(self._schema)
            matches = False
            if last:
                means = scalar_means(step.records, self._schema, self.device)
                # a metric object's step (its state tensors) travels on the object path
                matches = means is not None and not step.metrics
                flag = (torch.ones if matches else torch.zeros)((), dtype=torch.float64, device=self.device)
                loss = torch.stack(step.losses).mean().reshape(()).to(torch.float64)
                packed = torch.stack([flag, loss, *(means or [])])
                if not matches:
                    packed = torch.cat([packed, packed.new_zeros(k)])
                # the sender does not wait for its peers to receive: it has the values already, and waiting would
                # hold the last stage (done first in a step) until the first stage's last backward ends, then
                # start both ranks' optimizer steps and Lightning's loop in lockstep instead of overlapped (10% of
                # the host-overhead benchmark's step); the next step waits for it (finish_sending)
                self._sending = (dist.broadcast(packed, src=self._last_global_rank, group=group, async_op=True), packed)
            elif self._receiving is not None:
                work, packed = self._receiving
                self._receiving = None
                work.wait()
            else:
                packed = torch.empty(2 + k, dtype=torch.float64, device=self.device)
                dist.broadcast(packed, src=self._last_global_rank, group=group)
            if not last:
                matches = bool(packed[0].item())  # the step's one host read off the last stage
            if matches:
                values = packed.to(log_dtype())
                logged = [(name, value, args, kwargs) for (name, args, kwargs), value in zip(self._schema, values[2:])]
                return StepResults(packed[1].to(torch.get_default_dtype()), logged)
        payload: list[Any] = [None]
        if last:
            payload[0] = {
                "loss": torch.stack(step.losses).mean().item() if training else None,
                "records": self._metrics.referenced(merge_records(step.records)),
                "metrics": step.metrics,
                "outputs": None if training else _to_cpu(merge_microbatches(step.outputs)) if step.outputs else None,
            }
        dist.broadcast_object_list(payload, src=self._last_global_rank, group=group)
        result = payload[0]
        if not last:
            self._metrics.apply(result["metrics"])
        records = self._metrics.resolved(result["records"])
        if training:
            scalars = all(isinstance(value, float) for _, value, _, _ in records)
            self._schema = [(name, args, kwargs) for name, _, args, kwargs in records] if scalars else None
            return StepResults(torch.tensor(result["loss"], device=self.device), records)
        outputs = result["outputs"]
        if outputs is not None:
            outputs = apply_to_collection(outputs, Tensor, lambda t: t.to(self.device))
        return StepResults(outputs, records)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _to_cpu(obj: Any) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())
