"""Running a LightningModule's step through a pipeline schedule.

One step, on every rank of a pipeline: split the batch into micro-batches; run each micro-batch's step once, up to
its call of the network, in micro-batch order (pipeline/paused.py: the code before the call, its random draws and
side effects, run as on one device, and the call's arguments are known); learn what the step's network calls are
(pipeline/calls.py: the ranks without the last stage resume the steps with stand-ins up to their last call); run
torch's schedule over this rank's stages, each stage computing its part of the network for every call; on the last
stage, each micro-batch's step resumes with the network's output and computes its loss and logs. The step's loss and
logged values are then sent to every stage, so Lightning, callbacks and loggers see the real values on every rank and
nothing waits for a rank that never logs. Random draws: pipeline/random_streams.py.

The step is data (pipeline/step_data.py): a :class:`StepContext` handed to each stage module for the schedule's run, and
a :class:`StepResults` the strategy logs once. The per-step and per-micro-batch work here is on the host's critical
path (a pipeline step is many short actions): what the user's step logs is collected per micro-batch without
Lightning's ``self.log`` (pipeline/logged.py), and travels as one small tensor once the logged names are known
(``_share_results``); the stage swaps are built once (``NetworkSplit.active``); the paused steps run in worker
threads kept from step to step; and the received activation goes through an autograd function only where the
schedule takes input gradients from ``torch.autograd.grad`` (``NetworkSplit.attached``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import forward_replaced, tensors_in
from lightning_hybrid._torch_compat import module_parameters
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import to_plain
from lightning_hybrid.monitoring.metrics import MetricMirror
from lightning_hybrid.pipeline.boundaries import detached
from lightning_hybrid.pipeline.calls import CallPlan, agree_on_plan, run_past_calls
from lightning_hybrid.pipeline.checks import FirstStepChecks
from lightning_hybrid.pipeline.logged import LogCollector, log_dtype, merge_records, scalar_means
from lightning_hybrid.pipeline.microbatch import batch_size_of, merge_microbatches, split_batch
from lightning_hybrid.pipeline.module_state import StateMirror
from lightning_hybrid.pipeline.paused import (
    NetworkCall,
    PausedStep,
    StepThreads,
    ThreadState,
    mark_raised_by_the_step,
    paused_call,
)
from lightning_hybrid.pipeline.random_streams import RandomStreams
from lightning_hybrid.pipeline.schedule import boundaries, build_schedule, sendable
from lightning_hybrid.pipeline.stage import NetworkSplit, StageBoundary, StageModule
from lightning_hybrid.pipeline.stand_in import StandInOutputs
from lightning_hybrid.pipeline.step_data import ActionTimer, StepContext, StepResults, StepTimeline
from lightning_hybrid.pipeline.verify import PipelineVerifier, projection
from lightning_hybrid.pipeline_schedules import SCHEDULES, SPLIT_BACKWARD

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
        self._holds_last = self.last_stage in self.stages
        self._split_backward = schedule in SPLIT_BACKWARD
        self._cache: dict[tuple, tuple[Any, CallPlan, dict[int, tuple[Tensor, ...]]]] = {}
        self._param_tables: Optional[list[dict[str, Optional[nn.Parameter]]]] = None
        self._schema: Optional[list[tuple[str, tuple, dict]]] = None
        """Names, args and kwargs of the last training step's logged records when all were scalars: the next step's
        records then travel as one tensor. The same on every rank (learned from the object broadcast)."""
        self._stashed: list[tuple[nn.Parameter, Tensor]] = []
        self._timer, self._log = ActionTimer(dist.get_rank()), LogCollector()
        self._metrics, self._state = MetricMirror(module), StateMirror(module)  # from the last stage to the others
        self._threads = StepThreads()
        self._streams = RandomStreams(device)
        self._stand_in = StandInOutputs(split.unsplit, device)
        self._traces: tuple[Any, ...] = ()  # per network call of the current plan: the unsplit network's trace
        self.verifier: Optional[PipelineVerifier] = None
        """``verify_pipeline``: compares the first batch with an unsplit forward (the strategy sets it)."""
        self.context_probe: Any = None  # context parallel's first-step probe of the loss (context_parallel/verify.py)
        self._probe_output: Any = None  # micro-batch 0's network output on the last stage, for the probe
        self._checks_pending = True
        self.verification: Optional[dict[str, float]] = None
        """On the rank that ran ``verify_pipeline``'s comparison: the values it compared."""
        self._sends: dict[int, tuple[Tensor, ...]] = {}
        """Per stage of this rank but the last: an example of what it sends for each network call."""
        self._differentiated: Optional[frozenset[str]] = None
        """The parameters one device's forward differentiates on those inputs (None: not known)."""
        self._sending: Optional[tuple[Any, Tensor]] = None
        """The last stage's broadcast of the previous step's results, still in flight (work, buffer)."""
        self._receiving: Optional[tuple[Any, Tensor]] = None
        """This step's results broadcast, received early on the first stage's rank (see ``_receive_early``)."""
        # gloo runs an asynchronous collective on its own thread, apart from the point-to-point transfers, so the
        # first stage's rank can post its receive of the step's results before its last action (NCCL orders a
        # communicator's operations as issued: there the receive is posted after the schedule, as the peers' are)
        group = pp_mesh.get_group()
        self._receive_early = 0 in self.stages and not self._holds_last and dist.get_backend(group) == "gloo"
        self._last_global_rank = dist.get_global_rank(group, split.plan.owner[self.last_stage])
        # the rank that learns the steps' network calls for everyone: the first one without the last stage (None in
        # a one-stage pipeline: no boundary to size, the last stage serves every call of its steps)
        sources = [r for r in range(pp_mesh.size()) if self.last_stage not in split.plan.stages_of(r)]
        self._source = dist.get_global_rank(group, sources[0]) if sources else None

    # ------------------------------------------------------------------ public
    @property
    def timeline(self) -> StepTimeline:
        """This rank's compute actions of the last step."""
        return self._timer.timeline

    def close(self) -> None:
        """End the worker threads of the paused steps (the strategy's teardown)."""
        self._threads.close()

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
        step = StepContext(mode, microbatches, extra, [], self._run_stage)
        step.records, step.loss_scale = [[] for _ in range(m)], loss_scale
        last = self._holds_last
        previous = self._take_gradients() if training else []
        checks_done = not self._checks_pending
        self._state.begin()
        if last:  # the last stage keeps what the steps add to its metrics, and mirrors it to the others
            self._metrics.begin()
        try:
            with self._log.installed(self.module), forward_replaced(self.network, _network_call):
                with nullcontext() if last else self._metrics.unchanged():  # runs on stand-ins must not count
                    self._start_steps(step)
                    self._streams.begin()
                    schedule = self._prepare(step, training)
                if training and self._checks_pending:
                    # the first training step checks the cut before any optimizer step: verify_pipeline first (a
                    # projection of the network's output, no user code), then the structural checks in the step
                    self._checks_pending = False
                    if self.verifier is not None:
                        self._verify(step, schedule)
                    step.checks = FirstStepChecks(self.network, self.split, differentiated=self._differentiated)
                self._timer.begin(self._early_receive(m) if training and checks_done else None)
                self._streams.use("network")
                self._execute(step, schedule, training)
                self._timer.end()
                if not last:  # the code after the steps' last network call, on stand-ins: the output is not here
                    with self._metrics.unchanged():
                        run_past_calls(step.steps, self._stand_in, self._streams, until=None)
        finally:
            for paused in step.steps:  # a step left paused by an error: its thread ends it
                paused.end()
            self._streams.end()
            if last:
                step.metrics, step.state = self._metrics.end(), self._state.changes()
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

    # ------------------------------------------------------------------ the steps before the schedule
    def _start_steps(self, step: StepContext) -> None:
        """Run each micro-batch's step up to its first network call, in micro-batch order (pipeline/paused.py); what
        it logs meanwhile is kept on the last stage."""
        state = ThreadState.capture()
        run = getattr(self.module, step.mode)
        for i, microbatch in enumerate(step.microbatches):
            paused = PausedStep(partial(run, microbatch, *step.extra), self._threads, state)
            step.steps.append(paused)
            self._log.sink = step.records[i] if self._holds_last else None
            try:
                paused.start()
            finally:
                self._log.sink = None
            if paused.pending is None:
                raise HybridConfigError(
                    f"Under pipeline parallel, `{step.mode}` must call the network ({type(self.network).__name__});"
                    f" micro-batch {i}'s did not. If another module is the network, pass"
                    " `HybridStrategy(pipeline_network='<its name>')`; if the step calls no network at all, it cannot"
                    " be pipelined."
                )

    def _prepare(self, step: StepContext, training: bool) -> Any:
        """The schedule for this step's network calls (built once per shape of the network's inputs), with the steps
        of the ranks without the last stage run on to their last call."""
        first = step.steps[0].calls[0]
        # keyed by the network inputs' shapes, so the boundaries are found again only when they change
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors_in((first.args, first.kwargs)))
        # and by the step: each step function may call the network a different number of times
        key = (step.mode, len(step.microbatches), shapes, torch.is_autocast_enabled(self.device.type))
        cached = self._cache.get(key)
        if cached is None:
            plan = self._learn_plan(step)
        else:
            plan = cached[1]
            if not self._holds_last:
                counts, _, _ = run_past_calls(step.steps, self._stand_in, self._streams, until=plan.calls)
                if any(c != plan.calls for c in counts):
                    raise HybridConfigError(
                        f"Under pipeline parallel, each `{step.mode}` must call the network the same number of times"
                        f" for inputs of the same shapes: these micro-batches called it {counts} times, earlier ones"
                        f" {plan.calls}."
                    )
        # where a value read of the output ends the step on the stand-in ranks, numbers it sets after are mirrored too
        step.calls, self._state.every_value = plan.calls, plan.stopped is not None
        if cached is None:
            schedule, self._sends = build_schedule(
                self.stages, self.split, plan, name=self.schedule_name, training=training,
                microbatches=len(step.microbatches), device=self.device, activation_shape=self.activation_shape,
                group=self.pp_mesh.get_group(), timer=self._timer,
            )  # fmt: skip
            self._cache[key] = (schedule, plan, self._sends)
            return schedule
        schedule, _, self._sends = cached
        self._learn(plan)
        return schedule

    def _learn_plan(self, step: StepContext) -> CallPlan:
        """What the steps' network calls are, from the source rank to every rank of the pipeline (collective)."""
        if self._source is None:
            return CallPlan(calls=0, entering=((),), traces=(None,))
        found = None
        if dist.get_rank() == self._source:
            counts, stopped, refusal = run_past_calls(step.steps, self._stand_in, self._streams, until=None)
            calls = counts[0]
            if refusal is None and len(set(counts)) > 1:
                refusal = f"its micro-batches call the network different numbers of times ({counts})"
            refusal = f"`{step.mode}` cannot be pipelined: {refusal}." if refusal is not None else None
            entering: list[tuple] = []
            traces: list[Any] = []
            try:
                for c in range(calls if refusal is None else 0):
                    call = step.steps[0].calls[c]
                    specs, trace = boundaries(self.split, self.stages, self._network_forward, call,
                                              training=self.network.training, device=self.device)  # fmt: skip
                    entering.append(tuple((spec.shape, spec.dtype) for spec in specs))
                    traces.append(trace)
            except HybridConfigError as error:  # the cut does not fit these inputs: every rank refuses alike
                refusal = str(error)
            found = CallPlan(calls, tuple(entering), tuple(traces), refusal, stopped)
        plan = agree_on_plan(found, self._source, self.pp_mesh.get_group())
        if plan.refusal is None and plan.calls > 1 and self._holds_last and len(self.stages) > 1:
            plan = CallPlan(plan.calls, refusal=(
                f"`{step.mode}` cannot be pipelined: it calls the network {plan.calls} times, and under"
                " `pipeline_schedule="
                f"'{self.schedule_name}'` the rank holding the last stage holds others too, whose inputs for the"
                " later calls exist only once the last stage's output of the first call does; use"
                " `pipeline_schedule='1f1b'` or `'gpipe'`."
            ))  # fmt: skip
        if plan.refusal is not None:
            raise HybridConfigError(plan.refusal)
        if not self._holds_last and dist.get_rank() != self._source:
            run_past_calls(step.steps, self._stand_in, self._streams, until=plan.calls)
        self._learn(plan)
        return plan

    def _learn(self, plan: CallPlan) -> None:
        """What the plan's trace of the network shows for these inputs: the parameters one device differentiates,
        and (the split's) what each stand-in for another stage's block returns."""
        self._traces = plan.traces
        trace = plan.traces[0] if plan.traces else None
        self._differentiated = trace.used if trace is not None else None
        self.split.learn(trace)

    # ------------------------------------------------------------------ the schedule's run
    def _execute(self, step: StepContext, schedule: Any, training: bool) -> None:
        """One run of the schedule over ``step``'s micro-batches on this rank's stages, which read ``step``."""
        ids = torch.arange(len(step.microbatches), device=self.device)
        args = (ids,) if 0 in self.stages else ()
        kwargs: dict[str, Any] = {"target": ids, "losses": []} if self._holds_last and training else {}
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
        """``verify_pipeline``: a pipeline step on micro-batch 0's network call (the first replica's, on every
        replica) in eval mode, in which only the first micro-batch counts and the last stage returns a fixed random
        projection of the network's output instead of running the user's step; its value and gradient norm against
        the unsplit copy's on one rank. The user's code does not run again; the gradients it makes are dropped."""
        verifier = self.verifier
        assert verifier is not None
        self.verifier = None
        m = len(first.microbatches)
        verifier.refresh(self.network)
        call = first.steps[0].calls[0]
        args, kwargs = verifier.common_microbatch(detached((call.args, call.kwargs)))
        probe = NetworkCall(args, kwargs, call.state)
        step = StepContext(first.mode, first.microbatches, first.extra, first.steps, self._run_stage)
        step.calls, step.probe = first.calls, probe
        step.records, step.weights = [[] for _ in range(m)], [1.0] + [0.0] * (m - 1)
        # a stage failing on the probe is reported on every rank, as in the real step (which is checked again)
        step.checks = FirstStepChecks(self.network, self.split, differentiated=self._differentiated)
        with verifier.deterministic(self.module, verifier.reference):
            self._execute(step, schedule, True)
            step.checks.check_gradients(self.stages)
            step.checks.raise_together()
            norm = verifier.gradient_norm(self.module)
            for p in self.module.parameters():
                p.grad = None
            reference = None
            if verifier.reference is not None:
                copy = verifier.reference.to(self.device)  # copied at set-up, before the model moved to its device
                verifier.measured = (float(step.losses[0]), norm)
                with call.state.applied():
                    reference = verifier.reference_values(lambda: projection(copy(*args, **kwargs)))
            verifier.compare(reference)
        self.verification = verifier.result

    def _run_stage(self, step: StepContext, stage: int, received: tuple[Tensor, ...]) -> Any:
        """A stage module's forward for the next micro-batch of ``step`` (torch's schedule calls it)."""
        mb = step.counters[stage]
        step.counters[stage] += 1
        got = None if stage == 0 else received
        checks = step.checks
        if checks is None:
            return self._stage_forward(step, stage, mb, got)
        try:
            out = self._stage_forward(step, stage, mb, got)
        except Exception as error:
            # the first step: record it and go on with a stand-in, so the schedule's peers are not left waiting;
            # every rank raises it after the step (FirstStepChecks.raise_together)
            checks.failed(stage, error)
            out = self._failed_output(stage, got)
            if stage == self.last_stage and step.mode == "training_step":
                step.losses.append(out.detach().reshape(()))
            return out
        if mb == 0:
            first_out = out if isinstance(out, Tensor) else out[0]
            checks.check_output(stage, got[0] if got else None, first_out, stage == self.last_stage)
        return out

    def _failed_output(self, stage: int, received: Optional[tuple[Tensor, ...]]) -> Any:
        """What a stage that failed at the first step hands on: zeros of its outputs' shapes, in autograd."""
        link = sum(r.sum() * 0 for r in received) if received else None
        if stage == self.last_stage:
            base = torch.zeros(1, device=self.device)
            return base + link if link is not None else base.requires_grad_()
        outs = tuple(
            torch.zeros_like(e) + link if link is not None else torch.zeros_like(e).requires_grad_()
            for e in self._sends[stage]
        )
        return outs if len(outs) > 1 else outs[0]

    def _stage_forward(self, step: StepContext, stage: int, mb: int, received: Optional[tuple[Tensor, ...]]) -> Any:
        paused = step.steps[mb]
        if stage != self.last_stage:
            calls = [step.probe] * step.calls if step.probe is not None else paused.calls[: step.calls]
            outs = tuple(
                sendable(
                    self.split,
                    stage,
                    self._sends[stage][c],
                    self._partial_forward(step, stage, received[c] if received else None, call, c),
                    traced=self._differentiated is not None,
                )
                for c, call in enumerate(calls)
            )
            return outs if len(outs) > 1 else outs[0]
        if step.probe is not None:  # verify_pipeline: a projection of the output, every call slot connected
            outs = [self._partial_forward(step, stage, r, step.probe) for r in received or (None,)]
            if step.checks is not None and mb == 0:
                step.checks.check_network_output(outs[0])
            value = projection(outs[0]) + sum(projection(o) * 0 for o in outs[1:])
            step.losses.append(value.detach())
            return (value.float() * step.weights[mb]).reshape(1)  # type: ignore[index]
        c = 0
        while c < step.calls or (step.calls == 0 and paused.pending is not None):  # 0: a one-stage pipeline
            call = paused.pending
            if call is None:
                raise HybridConfigError(
                    f"`{step.mode}` called the network {c} time(s) for micro-batch {mb}; the pipeline's schedule for"
                    f" inputs of these shapes carries {step.calls} call(s) a micro-batch. A step must call the network"
                    " the same number of times for inputs of the same shapes."
                )
            out = self._partial_forward(step, stage, received[c] if received else None, call, c)
            if step.checks is not None and mb == 0 and c == 0:
                step.checks.check_network_output(out)
                if self.context_probe is not None:
                    self._probe_output = out
            self._log.sink = step.records[mb]
            self._streams.use(("after", mb))
            try:
                paused.resume(out)
            except Exception as error:
                mark_raised_by_the_step(error)
                raise
            finally:
                self._streams.use("network")
                self._log.sink = None
            c += 1
        if paused.pending is not None:
            raise HybridConfigError(
                f"`{step.mode}` called the network more than {step.calls} time(s) for micro-batch {mb}; the pipeline's"
                " schedule for inputs of these shapes carries that many calls a micro-batch. A step must call the"
                " network the same number of times for inputs of the same shapes."
            )
        out = paused.result
        if isinstance(out, DTensor) or not isinstance(out, Tensor):
            out = apply_to_collection(out, DTensor, to_plain)
        if step.mode != "training_step":
            step.outputs.append(apply_to_collection(out, Tensor, lambda t: t.detach()))
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        loss = out if isinstance(out, Tensor) else out["loss"]
        step.losses.append(loss.detach())
        if isinstance(out, Mapping) and len(out) > 1:  # the step's other outputs reach Lightning's `outputs`
            others = {k: v for k, v in out.items() if k != "loss"}
            step.outputs.append(apply_to_collection(others, Tensor, Tensor.detach))
        # the micro-batch mean gives the full batch's mean-loss gradient, as on one device
        # shape [1], not a scalar: schedules concatenate last-stage outputs across micro-batches
        # in fp32: a scaled fp16 loss would overflow fp16 (4.0 x 2**16 > 65504)
        weight = step.weights[mb] if step.weights is not None else step.loss_scale / len(step.microbatches)
        return (loss.float() * weight).reshape(1)

    def _partial_forward(
        self, step: StepContext, stage: int, received: Optional[Tensor], call: NetworkCall, index: int = 0
    ) -> Any:
        """The network's forward on ``call`` (the step's ``index``-th) restricted to ``stage`` (the split's swaps, and
        its hooks reading ``step.active``), under the thread state the step called it with: the stage's output
        activation, or the network's output on the last stage."""
        if len(self._traces) > 1:  # what the stand-ins for other stages' blocks return, for this call's inputs
            self.split.learn(self._traces[min(index, len(self._traces) - 1)])
        step.active = (stage, received)
        if step.checks is not None:  # each call runs the network's forward from its start
            step.checks.begin()
        try:
            with self.split.active(stage), call.state.applied():
                return self._network_forward(*call.args, **call.kwargs)
        except StageBoundary as boundary:
            return boundary.output
        finally:
            step.active = None

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
                # a metric object's step (its state tensors) and the step's other outputs travel on the object path
                matches = means is not None and not step.metrics and not step.outputs and step.state is None
                flag = (torch.ones if matches else torch.zeros)((), dtype=torch.float64, device=self.device)
                loss = torch.stack(step.losses).mean().reshape(()).to(torch.float64)
                # always 2 + k values, as the receivers expect; on the object path the values are not read
                packed = torch.stack([flag, loss, *(means if matches else [flag.new_zeros(())] * k)])  # type: ignore[misc]
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
                "state": step.state,
                # a training step's outputs besides its loss (a dict's other keys), or another step's outputs
                "outputs": _to_cpu(merge_microbatches(step.outputs)) if step.outputs else None,
            }
        dist.broadcast_object_list(payload, src=self._last_global_rank, group=group)
        result = payload[0]
        if not last:
            self._metrics.apply(result["metrics"])
            self._state.apply(result["state"], self.device)
        records = self._metrics.resolved(result["records"])
        outputs = result["outputs"]
        if outputs is not None:
            outputs = apply_to_collection(outputs, Tensor, lambda t: t.to(self.device))
        if training:
            scalars = all(isinstance(value, float) for _, value, _, _ in records)
            self._schema = [(name, args, kwargs) for name, _, args, kwargs in records] if scalars else None
            loss = torch.tensor(result["loss"], device=self.device)
            # as the step returned it: its other outputs merged over the micro-batches (dim 0), for on_train_batch_end
            return StepResults({"loss": loss, **outputs} if outputs is not None else loss, records)
        return StepResults(outputs, records)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _to_cpu(obj: Any) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


def _network_call(*args: Any, **kwargs: Any) -> Any:
    """The pipelined network's forward while the runner runs a step: the calling step pauses there (paused.py)."""
    return paused_call(args, kwargs)
