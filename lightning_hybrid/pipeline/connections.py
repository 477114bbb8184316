"""What a block reads from another stage outside the block list's hidden state, read off the meta trace.

A pipeline stage receives one tensor: the hidden state its previous stage's last block returned. Anything else a
block reads that an earlier block or an input module made (a U-Net's skip from a down block to its up block, a
position embedding added again further on) is, on a stage that does not hold its maker, the output of a stand-in:
zeros, and the model trains wrong without an error. Before this analysis the structural checks of the first step did
not see it (every parameter still gets a gradient); only ``verify_pipeline``'s numeric comparison did, and it is off
in 16-bit precision and above 100M parameters.

:class:`Provenance` follows, during the trace's forward (pipeline/boundaries.py), which blocks' outputs and which
input modules' outputs each tensor was computed from (a ``TorchFunctionMode``: every torch function and tensor method
the forward calls passes the union of its inputs' sources on to its outputs; ops that read only a tensor's shape,
dtype or device, such as ``zeros_like``, pass nothing). A block's outputs and an input module's outputs start a new
source. What each block takes, and what the network returns, are then :class:`Connection` s; those whose two ends
land on different stages of a cut are refused before training, naming both ends and a partition that keeps them
together, when one exists (:func:`check_connections`). Costs nothing per step: one pass of the trace, on meta or fake
tensors, per new shape of the network's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid._hooks import first_tensor, tensors_in
from lightning_hybrid.pipeline.partition import StagePlan

__all__ = ["Connection", "Provenance", "Source", "allowed_cuts", "balanced_counts", "check_connections"]

# Tensor functions whose output's values do not depend on their tensor inputs' values (only on shape, dtype, device):
# a mask made with ``x.new_ones(...)`` from the embedding's output does not read that output
VALUE_FREE = frozenset({
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "new_tensor", "size", "dim", "numel", "stride", "element_size",
})  # fmt: skip


@dataclass(frozen=True)
class Source:
    """Where a value comes from: ``kind`` is ``"block"`` (the hidden state block ``index`` returned), ``"extra"``
    (another tensor block ``index`` returned, e.g. a U-Net down block's skip) or ``"input"`` (the output of the input
    module ``name``, which only the first stage holds)."""

    kind: str
    index: int = -1
    name: str = ""


@dataclass(frozen=True)
class Connection:
    """A value read by block ``reader`` (None: by the network's output, on the last stage) that ``source`` made, other
    than the hidden state the previous block hands on."""

    source: Source
    reader: Optional[int]
    where: str
    """How the reader takes it: ``"hidden state"``, ``"argument `1`"``, ``"argument `skip`"``."""

    def stages(self, plan: StagePlan) -> tuple[int, int]:
        """The stage that makes the value and the stage that reads it."""
        last = len(plan.counts) - 1
        made = 0 if self.source.kind == "input" else plan.stage_of(self.source.index)
        return made, last if self.reader is None else plan.stage_of(self.reader)

    def describe(self, plan: StagePlan, blocks_name: str) -> str:
        made, read = self.stages(plan)
        if self.source.kind == "input":
            what = f"the output of `{self.source.name}` (an input module: stage 0 holds it, the others a zero stand-in)"
        elif self.source.kind == "block":
            what = f"the hidden state `{blocks_name}.{self.source.index}` returns (stage {made})"
        else:
            what = f"a tensor `{blocks_name}.{self.source.index}` returns besides its hidden state (stage {made})"
        if self.reader is None:
            return f"the network's output (stage {read}) is computed from {what}"
        return f"`{blocks_name}.{self.reader}` (stage {read}) takes {what} as its {self.where}"


class Provenance(TorchFunctionMode):
    """While active: each tensor an op makes carries the sources of the tensors the op read (see the module's
    docstring). :meth:`start` marks a block's or an input module's outputs as a new source."""

    def __init__(self) -> None:
        super().__init__()
        self._of: dict[int, frozenset[Source]] = {}
        self._alive: list[Tensor] = []  # the traced tensors stay alive until the trace ends: no id is reused

    def of(self, obj: Any) -> frozenset[Source]:
        """The sources of every tensor in ``obj``."""
        return frozenset().union(*(self._of.get(id(t), frozenset()) for t in tensors_in(obj)))

    def start(self, tensors: Iterable[Tensor], source: Source) -> None:
        for t in tensors:
            self._set(t, frozenset({source}))

    def _set(self, t: Tensor, sources: frozenset[Source]) -> None:
        if id(t) not in self._of:
            self._alive.append(t)
        self._of[id(t)] = sources

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in VALUE_FREE:
            return out
        found = self.of((args, kwargs))
        if found:
            # an in-place op that returns nothing (``x[i] = y``) changes its first argument
            touched = tensors_in(out) or (tensors_in(args[:1]) if name == "__setitem__" else [])
            for t in touched:
                self._set(t, self._of.get(id(t), frozenset()) | found)
        return out


def hidden_output(output: Any) -> Optional[Tensor]:
    """The hidden state in a block's output: the output itself, or its first tensor (what a stage sends on)."""
    return output if isinstance(output, Tensor) else next(iter(tensors_in(output)), None)


def record_connections(
    provenance: Provenance, blocks: Sequence[nn.Module], inputs: dict[str, nn.Module]
) -> tuple[list[Connection], Callable[[Any], None], list[Any]]:
    """Hooks on ``blocks`` (first call each) and on the input modules ``inputs`` (by name) that record, into the
    returned list, what each block reads from elsewhere than its previous block's hidden state; the returned function
    records what the network's output reads. The hook handles come last (remove them when the trace ends)."""
    found: list[Connection] = []
    read: set[int] = set()

    def before(i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if i in read:
                return
            read.add(i)
            hidden = first_tensor(args, kwargs)
            for where, value in [*enumerate(args), *kwargs.items()]:
                is_hidden = hidden is not None and where == hidden[0]
                label = "hidden state" if is_hidden else f"argument `{where}`"
                for source in provenance.of(value):
                    if is_hidden and source == Source("block", i - 1):
                        continue  # the chain the stage boundary carries
                    found.append(Connection(source, i, label))

        return hook

    def after(i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            hidden = hidden_output(output)
            provenance.start([t for t in tensors_in(output) if t is not hidden], Source("extra", i))
            provenance.start([hidden] if hidden is not None else [], Source("block", i))

        return hook

    def made_by(name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # one called after the blocks began is placed on the wrong side of them: the first step's checks name it
            # (pipeline/checks.py: a stand-in ran after the stage's first block)
            if not read:
                provenance.start(tensors_in(output), Source("input", name=name))

        return hook

    def network_output(out: Any) -> None:
        for source in provenance.of(out):
            # another tensor a block returned (router logits, every layer's attentions) is for the first step's check
            # of the network's output (pipeline/checks.py), which names the field and its own fix
            if source.kind != "extra":
                found.append(Connection(source, None, "output"))

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(block.register_forward_hook(after(i)))
    handles += [module.register_forward_hook(made_by(name)) for name, module in inputs.items()]
    return found, network_output, handles


def crossing(connections: Iterable[Connection], plan: StagePlan) -> list[Connection]:
    """The connections whose two ends ``plan`` puts on different stages."""
    seen: dict[Connection, None] = {}
    for c in connections:
        made, read = c.stages(plan)
        if made != read:
            seen.setdefault(c)
    return list(seen)


def allowed_cuts(connections: Iterable[Connection], num_blocks: int) -> set[int]:
    """The blocks after which a stage may end without cutting a connection (0-based)."""
    allowed = set(range(num_blocks - 1))
    for c in connections:
        reader = num_blocks if c.reader is None else c.reader  # the network's output is read after the last block
        start = 0 if c.source.kind == "input" else c.source.index  # an input module's output is made before block 0
        allowed -= set(range(start, reader))
    return allowed


def balanced_counts(num_blocks: int, stages: int, allowed: set[int]) -> Optional[list[int]]:
    """Block counts per stage, cutting only after blocks in ``allowed``, whose largest stage is smallest; None where
    no such partition exists.

    Example:
        >>> balanced_counts(6, 2, {1, 2, 3})
        [3, 3]
        >>> balanced_counts(6, 2, {1})
        [2, 4]
    """
    inf = num_blocks + 1
    # best[s][j]: the smallest largest stage splitting blocks [0, j) into s stages, the last ending at j
    best = [[inf] * (num_blocks + 1) for _ in range(stages + 1)]
    back = [[0] * (num_blocks + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(1, num_blocks + 1):
            if j < num_blocks and j - 1 not in allowed:
                continue
            for i in range(s - 1, j):
                if best[s - 1][i] < inf and max(best[s - 1][i], j - i) < best[s][j]:
                    best[s][j], back[s][j] = max(best[s - 1][i], j - i), i
    if best[stages][num_blocks] >= inf:
        return None
    counts, j = [], num_blocks
    for s in range(stages, 0, -1):
        counts.append(j - back[s][j])
        j = back[s][j]
    return counts[::-1]


def check_connections(
    connections: Sequence[Connection], plan: StagePlan, blocks_name: str, allowed: set[int]
) -> Optional[str]:
    """The refusal of a cut that leaves a connection between two stages (None where there is none): both ends of
    each, and a ``pipeline_partition`` that keeps them in one stage (cutting only after blocks in ``allowed``), when
    one exists."""
    crossed = crossing(connections, plan)
    if not crossed:
        return None
    shown = "; ".join(c.describe(plan, blocks_name) for c in crossed[:4]) + (" ..." if len(crossed) > 4 else "")
    stages = len(plan.counts)
    counts = balanced_counts(sum(plan.counts), stages, allowed)
    if counts is not None:
        fix = (
            f"Give `pipeline_partition={counts}`, which keeps both ends of each in one stage, or train without pipeline"
            " parallel (`pipeline_parallel_size=1`)."
        )
    else:
        most = len(allowed) + 1
        fewer = f" (at most {most} stages can keep them, ending after blocks {sorted(allowed)})" if most > 1 else ""
        fix = (
            f"No partition of the {sum(plan.counts)} blocks into {stages} stages keeps both ends of each in one"
            f" stage{fewer}: train this model without pipeline parallel (`pipeline_parallel_size=1`); tensor"
            " parallel, data parallel and ZeRO need no cut."
        )
    return (
        f"`pipeline_parallel_size` > 1: the cut {list(plan.counts)} of `{blocks_name}` separates values the forward"
        f" passes outside the hidden state from where they are read: {shown}. A stage receives only the hidden state"
        " its previous stage's last block returns; there these values would be a stand-in's zeros, and the model"
        f" would train wrong. {fix}"
    )
