"""No silent wrong pipeline: the structural checks of the first training step.

The stage cut (pipeline/stage.py) replays the network's own ``forward`` with stand-ins for what other stages hold. A
forward that does not fit the cut (a module placed on one side of the block list and called on the other, a
hidden state the first block does not take first) would train wrong without an error. The structural checks run at
the first training step on every stage, and every rank raises the same :class:`HybridConfigError`: the activation a
stage received reaches its output (on the last stage: the loss), every parameter of the stage got a gradient, and no
stand-in for a module another stage holds ran after the stage's blocks had started. They cost one walk of micro-batch
0's autograd graph per stage and one small object all-gather. ``verify_pipeline`` (pipeline/verify.py) is the
numeric check beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid._hooks import tensors_in
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.pipeline.paused import raised_by_the_step
from lightning_hybrid.pipeline.stage import InputStub, NetworkSplit

__all__ = ["FirstStepChecks"]

_COLLECTED_FIELDS = "the network's output field(s)"


# ---------------------------------------------------------------------------------------------- structural checks
def _depends_on(output: Tensor, received: Tensor) -> bool:
    """Whether ``received`` is in the autograd graph of ``output`` (a walk from ``output.grad_fn``)."""
    if output.grad_fn is None:
        return False
    target = received.grad_fn
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node is target or (target is None and getattr(node, "variable", None) is received):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


@dataclass
class FirstStepChecks:
    """The structural checks of the first training step on this rank's stages; :meth:`raise_together` shares them."""

    network: nn.Module
    split: NetworkSplit
    differentiated: Optional[frozenset[str]] = None
    """The parameters (names relative to the network) that one device's forward of the first micro-batch
    differentiates (pipeline/boundaries.py); the others get no gradient on one device either. None: not known (the
    forward cannot run on meta tensors), and every parameter must get a gradient."""
    failures: list[str] = field(default_factory=list)
    _cut_off: set[int] = field(default_factory=set)
    """Stages whose output does not depend on their input, or that failed: their blocks' missing gradients follow
    from that."""
    in_the_step: list[str] = field(default_factory=list)
    """Errors of the user's own step that are not the cut's (its code after the network call)."""
    errors: list[BaseException] = field(default_factory=list)
    """Exceptions a stage's forward raised at the first step (the stage went on with a stand-in, so that no peer
    waits for it in the schedule's communication)."""
    _late: dict[int, set[str]] = field(default_factory=dict)
    _entered: Optional[int] = None
    _handles: list[Any] = field(default_factory=list)
    _received: set[int] = field(default_factory=set)
    """Parameters a gradient reached in backward: gradient buckets and fp32 masters take ``p.grad`` away at once."""
    _made_in_blocks: Optional[dict[int, Tensor]] = None
    """Tensors the last stage's blocks made inside them (their modules' outputs, the network's last block's own
    output excepted), while its first micro-batch runs: held, so that no id is reused before the check."""

    def __post_init__(self) -> None:
        names = self._module_names()
        for stage in self.split.local_stages():
            if stage != 0:
                first = self.split.blocks[self.split.plan.blocks(stage).start]
                self._handles.append(first.register_forward_pre_hook(self._enter(stage), prepend=True))
        for p in self.network.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p: self._received.add(id(p))))
        for module in self.network.modules():
            if isinstance(module, InputStub):
                self._handles.append(module.register_forward_pre_hook(self._stub_called(names.get(id(module), "?"))))
        last = self.split.num_stages - 1
        if last in self.split.local_stages():
            self._made_in_blocks = {}
            final = self.split.blocks[len(self.split.blocks) - 1]
            for i in self.split.plan.blocks(last):
                for module in self.split.blocks[i].modules():
                    if module is not final:
                        self._handles.append(module.register_forward_hook(self._record_made))

    def _module_names(self) -> dict[int, str]:
        return {id(m): n for n, m in self.network.named_modules()}

    def _enter(self, stage: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._entered = stage

        return hook

    def _stub_called(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if self._entered is not None:
                self._late.setdefault(self._entered, set()).add(name)

        return hook

    def _record_made(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._made_in_blocks is not None:
            self._made_in_blocks.update((id(t), t) for t in tensors_in(output))

    def check_network_output(self, out: Any) -> None:
        """Micro-batch 0 on the last stage: no field of the network's output holds a value made inside the blocks
        (a submodule's output, or a block's other than the network's last). Such a field collects from every block
        (transformers' router logits for a mixture of experts' load-balancing loss, every layer's hidden states or
        attentions), and on this stage it holds only this stage's blocks' values: the loss would differ from one
        device's, by little, in silence."""
        made, self._made_in_blocks = self._made_in_blocks, None
        if not made or isinstance(out, Tensor):
            return
        fields = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, (list, tuple)) else ()
        collected = [str(k) for k, v in fields if any(id(t) in made for t in tensors_in(v))]
        if collected:
            self.failures.append(
                f"pipeline stage {self.split.num_stages - 1} (the last): {_COLLECTED_FIELDS}"
                f" {', '.join(f'`{k}`' for k in collected)} hold values made inside the blocks"
                f" `{self._blocks_name()}`: the network collects them from every block (a mixture-of-experts model's"
                " router logits for its load-balancing loss, every layer's hidden states or attentions), and this"
                " stage runs only its own blocks, so whatever reads them would differ from one device. Do not ask"
                " the network for them under pipeline parallel (e.g. `output_router_logits=False`,"
                " `output_hidden_states=False`, `output_attentions=False`), or train without pipeline parallel"
                " (`pipeline_parallel_size=1`)."
            )

    def begin(self) -> None:
        """A stage's forward starts: its blocks have not run yet."""
        self._entered = None

    def check_output(self, stage: int, received: Optional[Tensor], output: Tensor, last: bool) -> None:
        """Micro-batch 0 of ``stage``: the activation received from the previous stage reaches ``output``."""
        if received is None or not received.requires_grad:
            return
        if _depends_on(output, received):
            return
        self._cut_off.add(stage)
        first = f"{self._blocks_name()}.{self.split.plan.blocks(stage).start}"
        if last:
            self.failures.append(
                f"pipeline stage {stage} (the last): the loss does not depend on the activation received from stage"
                f" {stage - 1}. A module the loss goes through after the block list is a stand-in on this stage"
                " (placed before the block list but called after it?), or the block list's hidden state is not"
                f" the first tensor input of `{first}`."
            )
        else:
            self.failures.append(
                f"pipeline stage {stage}: its output does not depend on the activation received from stage"
                f" {stage - 1}: the hidden state of the block list is not the first tensor input of `{first}` (the"
                " stage substitutes the received activation there), or the blocks are not called one after another."
            )

    def check_gradients(self, stages: dict[int, nn.Module]) -> None:
        """After the first step's backward: every parameter of each stage this rank holds got a gradient."""
        names = {id(p): n for n, p in self.network.named_parameters()}
        for stage, module in sorted(stages.items()):
            if stage in self._cut_off:
                continue
            missing = [
                names.get(id(p), "?")
                for p in module.parameters()
                if p.requires_grad
                and p.grad is None
                and id(p) not in self._received
                and self._expected(names.get(id(p)))
            ]
            if missing:
                shown = ", ".join(f"`{n}`" for n in missing[:6]) + (" ..." if len(missing) > 6 else "")
                self.failures.append(
                    f"pipeline stage {stage} holds {len(missing)} parameter(s) that got no gradient at the first step:"
                    f" {shown}. The stage runs the network's forward only between its blocks (the first stage also"
                    " before them, the last also after them): a module placed before the block list"
                    f" `{self._blocks_name()}` but called after it, or the other way round, is cut onto the wrong"
                    f" stage{self._placed()}.{self._unused_hint()}"
                )
        for stage, late in sorted(self._late.items()):
            self.failures.append(
                f"pipeline stage {stage}: the forward called {sorted(late)} after the stage's first block, but they"
                f" were placed before the block list `{self._blocks_name()}`{self._placed()}, so the first stage"
                " holds them and this stage ran a zero stand-in in their place."
            )

    def _expected(self, name: Optional[str]) -> bool:
        """Whether the parameter ``name`` gets a gradient on one device (where that is known)."""
        from lightning_hybrid.checkpoint.optimizer import state_dict_name

        return self.differentiated is None or name is None or state_dict_name(name) in self.differentiated

    def _unused_hint(self) -> str:
        if self.differentiated is not None:  # these parameters do get a gradient on one device
            return ""
        return (
            " (The forward could not run on meta tensors to show which parameters one device differentiates: if"
            " these are unused on one device too, set `requires_grad=False` on them.)"
        )

    def _placed(self) -> str:
        """How the cut placed modules whose call order it did not know (pipeline/stage.py ``call_order``)."""
        return f" ({self.split.placed})" if self.split.placed else ""

    def _blocks_name(self) -> str:
        return self._module_names().get(id(self.split.blocks), "blocks")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._made_in_blocks = [], None

    def raise_together(self) -> None:
        """Every rank raises one error listing what any rank found, the same message everywhere (collective over
        the world: an object all-gather of each rank's findings)."""
        self.close()
        found: list[tuple[list[str], list[str]]] = [(self.failures, self.in_the_step)]
        if dist.is_available() and dist.is_initialized():
            found = [([], []) for _ in range(dist.get_world_size())]
            dist.all_gather_object(found, (self.failures, self.in_the_step))
        in_the_step = list(dict.fromkeys(f for _, rank in found for f in rank))
        if in_the_step:  # the step's own error, not the cut's: said as it is
            raise HybridConfigError(" ".join(in_the_step)) from (self.errors[0] if self.errors else None)
        found_cut = [rank for rank, _ in found]
        # tensor-parallel and data-parallel peers of a stage find the same: each finding once, in stage order
        failures = sorted(dict.fromkeys(f for rank in found_cut for f in rank), key=_stage_of)
        placement = (
            " Train it without pipeline parallel, give the LightningModule an `example_input_array` on which its"
            " forward runs with meta tensors (the cut then follows the order in which the forward calls the"
            " modules), or register the modules on the side of the block list where the forward calls them."
        )
        if failures:
            # a field collected from every block has its own fix, said in its finding; the others are placements
            advice = "" if all(_COLLECTED_FIELDS in f for f in failures) else placement
            raise HybridConfigError(
                "The pipeline cut does not fit this network's forward, which would train wrong: "
                + " ".join(failures)
                + advice
            ) from (self.errors[0] if self.errors else None)

    def failed(self, stage: int, error: BaseException) -> None:
        """``stage``'s forward raised ``error`` at the first step (it went on with a stand-in, so its parameters'
        missing gradients follow from that, and are not reported); an error of the user's own step is said as it is,
        not as the cut's."""
        self._cut_off.add(stage)
        if raised_by_the_step(error):  # the user's own code after the network call, not the cut
            self.in_the_step.append(f"the step raised {type(error).__name__} on the last pipeline stage: {error}")
        elif isinstance(error, HybridConfigError):  # the strategy's own finding (a boundary's shape): said in full
            self.failures.append(f"{error}")
        elif not self.errors:
            # without the trace, a stand-in for another stage's block returns what the block's meta copy returns, or
            # its hidden-state input alone: a forward that unpacks or indexes a block's output fails on it
            why = (
                "it reads a module or attribute that another stage holds, or unpacks what a block returns: the"
                " network's forward could not run on meta tensors (it reads values), so what each block returns was"
                " not known to the stand-ins for other stages' blocks"
                if self.differentiated is None
                else "it reads a module or attribute that another stage holds?"
            )
            self.failures.append(
                f"pipeline stage {stage}: the network's forward failed on this stage with {type(error).__name__}:"
                f" {error} ({why})."
            )
        self.errors.append(error)


def _stage_of(finding: str) -> int:
    words = finding.split()
    return int(words[2].rstrip(":")) if len(words) > 2 and words[2].rstrip(":").isdigit() else -1
