"""The first training step's probe of the user's loss under context parallel: no copy of the network, any model size,
with or without a pipeline.

Attention, positions and a causal LM's ``labels=`` loss are exact under context parallel; a loss the user computes
from the network's outputs in ``training_step`` is not always: one that shifts its targets inside the step
(``logits[:, :-1]`` against ``targets[:, 1:]``) loses the pair across each part's boundary, and one that ignores
tokens (``ignore_index``, a mask) averages the context ranks' means although their counts differ. Both would train
wrong in silence. Context parallel optimizes the mean over the context ranks of each rank's loss on its part; that is
one device's loss for every batch only if the step's loss function ``L`` satisfies ``mean_r L(part_r) = L(whole)``.

The probe tests that identity on the loss function alone, at a size that does not depend on the model: on the ranks
that hold the network's output (every rank without a pipeline, the last stage under one), with the network's real
output on this rank's part of the first micro-batch, it runs the user's step three times with the network replaced by
a stand-in that returns given outputs as leaves requiring grad (nothing of the network runs, no parameter gets a
gradient):

1. on the whole part: which positions the loss reaches (its gradient at the per-token outputs is not zero there), to
   count per rank the positions it leaves out;
2. on ``PROBE_POSITIONS`` positions of the part (the same number on every rank, chosen so that ranks whose parts count
   different numbers of positions also count different numbers in the probe: the rank(s) leaving out the fewest take
   the positions the loss reaches most, the others those it leaves out most): ``loss_r`` and its gradient;
3. on the short whole, those positions of every rank gathered in rank order: ``loss_W`` and its gradient.

Compared: ``mean_r loss_r`` with ``loss_W``, and each position's gradient of the context-parallel loss (``1/cp`` of
the rank's own) with the short whole's, row by row (a token dropped or weighed differently changes its row entirely,
whatever the length). A mismatch beyond the precision's tolerance: every rank raises the same
:class:`~lightning_hybrid.HybridConfigError`, before the first optimizer step. The tolerance and the loss's error floor
are the pipeline check's (``pipeline/verify.py``).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._hooks import attribute_replaced, capture_call
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.context_parallel.batch import sequence_length
from lightning_hybrid.context_parallel.exchange import ContextShard
from lightning_hybrid.dtensor import full_tensor
from lightning_hybrid.pipeline.boundaries import map_tensors
from lightning_hybrid.pipeline.verify import LOSS_ERROR_FLOOR, LOW_PRECISION_TOLERANCE, TOLERANCES, deterministic
from lightning_hybrid.tensor_parallel.vocab import whole_logits
from lightning_hybrid.unseen_run import unseen_run

__all__ = ["PROBE_POSITIONS", "ContextLossProbe"]

PROBE_POSITIONS = 4
"""Positions of each rank's part in the probe: the short whole holds ``cp x 4`` positions, whose outputs (the logits:
``cp x 4 x vocab`` per sample) and their gradients are all the probe keeps beyond the step's own output."""


class ContextLossProbe:
    """The probe of the first training step (collective: call it on every rank, once; see the module's docstring).

    Example:
        >>> # probe = ContextLossProbe(shard, "model", precision="32-true")
        >>> # probe.check_step(module, "training_step", (batch, 0), {})   # without a pipeline
        >>> # probe.check_output(module, "training_step", microbatch, (0,), output)   # the pipeline's last stage
    """

    def __init__(self, shard: ContextShard, network_name: str, precision: str) -> None:
        self.shard, self.network_name = shard, network_name
        self.tolerance = TOLERANCES.get(precision, LOW_PRECISION_TOLERANCE)
        self.result: Optional[dict[str, float]] = None
        """The compared values where the probe ran (for tests and logs)."""

    def check_step(self, module: nn.Module, mode: str, args: tuple, kwargs: dict) -> None:
        """Without a pipeline: the network's output on this rank's part of the batch, computed without autograd
        (eval mode, the random state put back), then :meth:`check_output`."""
        if not self.network_name or not getattr(module, "automatic_optimization", True):
            _raise_first(None)  # nothing to probe; a manual step calls the optimizers itself: it would step them
            return
        network = module.get_submodule(self.network_name)
        with unseen_run(module, network), _quiet(module), deterministic(module):
            captured = capture_call(network, lambda: getattr(module, mode)(*args, **kwargs))
            with torch.no_grad():
                output = network(*captured[0], **captured[1]) if captured is not None else None
        self.check_output(module, mode, args[0], (*args[1:],), output, kwargs)

    def check_output(
        self, module: nn.Module, mode: str, batch: Any, extra: tuple, output: Any, kwargs: Optional[dict] = None
    ) -> None:
        """The probe on ``batch`` (this rank's part of the first micro-batch) and ``output`` (the network's output on
        it; None on a rank that holds no output: a pipeline's earlier stages), then every rank of the world raises the
        first finding of any rank (collective over the world)."""
        finding = None
        if output is not None and self.network_name and getattr(module, "automatic_optimization", True):
            network = module.get_submodule(self.network_name)
            # the step runs three more times here: nothing of those runs may reach what the user's code sees
            eager = torch.compiler.set_stance("force_eager")
            with unseen_run(module, network), _quiet(module), deterministic(module), eager:
                try:
                    finding = self._probe(module, mode, batch, extra, kwargs or {}, _detached(output))
                except Exception as error:  # reported on every rank, not left for the other stages to wait on
                    finding = self._failed(mode, error)
        _raise_first(finding)

    # ------------------------------------------------------------------ the probe
    def _probe(self, module: nn.Module, mode: str, batch: Any, extra: tuple, kwargs: dict, output: Any) -> Any:
        shard = self.shard
        length = sequence_length(batch)
        if not length:
            return None  # no sequence to split (alike on every context rank)
        run = _StepRunner(module, self.network_name, mode, extra, kwargs)
        full = run(batch, output, {id(t) for t in _tensors(output) if t.dim() >= 2 and t.size(1) == length})
        if full is None:
            return None  # the step returned no single loss (alike on every context rank)
        left_out = _left_out_per_position(full[1], length)
        totals = torch.tensor([float(left_out.sum())])
        gathered = [torch.empty_like(totals) for _ in range(shard.size)]
        dist.all_gather(gathered, totals, group=shard.group)
        counts = [int(t) for t in gathered]
        fewest = counts[shard.rank] == min(counts)
        k = min(PROBE_POSITIONS, length)
        order = sorted(range(length), key=lambda j: (int(left_out[j]) * (1 if fewest else -1), j))
        chosen = torch.tensor(sorted(order[:k]))
        part_batch, batch_cut = _positions(batch, chosen, length)
        part_output, output_cut = _positions(output, chosen, length)
        own = run(part_batch, part_output, output_cut)
        whole_output, whole_cut = _gathered(part_output, output_cut, shard, average_others=True)
        whole = run(_gathered(part_batch, batch_cut, shard)[0], whole_output, whole_cut)
        assert own is not None and whole is not None  # the same step on the same kinds of values
        (loss, grads), (whole_loss, whole_grads) = own, whole
        mean = torch.tensor([loss / shard.size])
        dist.all_reduce(mean, group=shard.group)
        mean_loss = float(mean)
        row_error, row_scale = 0.0, 0.0
        for g, w in zip(grads, whole_grads):
            parts = [torch.empty_like(g) for _ in range(shard.size)]
            dist.all_gather(parts, g.contiguous(), group=shard.group)
            context = torch.cat(parts, dim=1) / shard.size  # each rank's loss counts 1/cp in the step's
            row_error = max(row_error, float(_row_norms(context - w).max()))
            row_scale = max(row_scale, float(_row_norms(w).max()))
        loss_error = abs(mean_loss - whole_loss) / max(abs(whole_loss), LOSS_ERROR_FLOOR)
        if not math.isfinite(whole_loss) and not math.isfinite(mean_loss):
            loss_error = 0.0  # a step that is not finite on one device either: not the split's doing
        grad_error = row_error / row_scale if row_scale else (math.inf if row_error else 0.0)
        self.result = {"loss": mean_loss, "whole_loss": whole_loss, "loss_error": loss_error,
                       "gradient_error": grad_error, "left_out": float(sum(counts))}  # fmt: skip
        if loss_error <= self.tolerance and grad_error <= self.tolerance:  # NaN fails
            return None
        return self._finding(counts, mean_loss, whole_loss, loss_error, grad_error, k)

    def _failed(self, mode: str, error: Exception) -> str:
        return (
            f"`context_parallel_size={self.shard.size}`: the first-step probe of the loss could not run {mode} on"
            f" {PROBE_POSITIONS} positions of each part of the sequence and on those positions as one sequence, with"
            f" the network's outputs given ({type(error).__name__}: {error}). The step must compute its loss for a"
            " sequence of any length from what the network returns and the batch (context parallel gives it"
            " `seq / cp` positions). Compute the loss through the model's `labels=` argument, or train with"
            " `context_parallel_size=1` (docs/context-parallel.md)."
        )

    def _finding(
        self, counts: list[int], loss: float, whole_loss: float, loss_error: float, grad_error: float, k: int
    ) -> str:
        cp = self.shard.size
        if len(set(counts)) > 1:
            found = (
                "it counts different numbers of tokens on the context ranks (the loss leaves out"
                f" {', '.join(map(str, counts))} (sample, position) pairs of the ranks' parts: `ignore_index`, a mask)"
                " and averages each rank's own, which weighs the ranks' tokens unequally"
            )
        else:
            found = (
                "it depends on pairs of positions across the parts' boundary (targets shifted inside the step:"
                " `logits[:, :-1]` against `targets[:, 1:]` loses the pair at each boundary) or weighs the parts'"
                " positions otherwise than one mean over the whole sequence"
            )
        return (
            f"`context_parallel_size={cp}`: the first batch's loss, as training_step computes it on each context"
            f" rank's part of the sequence, is not one device's: {found}. Probed on the loss alone, with the"
            f" network's outputs at {k} positions of each part and at those {cp * k} positions as one sequence: mean"
            f" of the ranks' losses {loss:.6g} vs {whole_loss:.6g} (error {loss_error:.1e}), gradient at the outputs"
            f" off by {grad_error:.1e} of its largest position; tolerance {self.tolerance:g}{_nan(loss)}. Compute"
            " the loss through the model's `labels=` argument (which context parallel shifts and counts over the whole"
            " sequence), give the step targets already shifted in the data (`(x, y)` windows) with every token"
            f" counted, or train with `context_parallel_size=1` (docs/context-parallel.md)."
        )


def _nan(loss: float) -> str:
    return "" if math.isfinite(loss) else " (not finite: a rank's probed positions count no token)"


class _GivenOutput(nn.Module):
    """Stands in for the network during the probe: returns the output it holds, whatever it is called with; its other
    attributes are the network's (``self.model.config``). No hook of the network (ZeRO-3's) runs."""

    def __init__(self, network: nn.Module, output: Any) -> None:
        super().__init__()
        self.__dict__["_network"], self.__dict__["_output"] = network, output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._output

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_network"], name)


class _StepRunner:
    """Runs the user's step on given values: the network replaced by :class:`_GivenOutput`, its floating outputs
    fresh leaves. Returns the step's loss and its gradient at the per-token outputs (zeros where the loss does not
    reach), or None when the step returns no single loss."""

    def __init__(self, module: nn.Module, network_name: str, mode: str, extra: tuple, kwargs: dict) -> None:
        self.module, self.mode, self.extra, self.kwargs = module, mode, extra, kwargs
        parent_name, _, self.child = network_name.rpartition(".")
        self.parent = module.get_submodule(parent_name)

    def __call__(self, batch: Any, given: Any, per_token_ids: set[int]) -> Optional[tuple[float, list[Tensor]]]:
        """``per_token_ids``: the ids of ``given``'s tensors that hold one value per position (dimension 1)."""
        leaves: list[tuple[Tensor, bool]] = []
        output = map_tensors(lambda t: _leaf(t, leaves, id(t) in per_token_ids))(given)
        network = getattr(self.parent, self.child)
        with _replaced(self.parent, self.child, _GivenOutput(network, output)), torch.enable_grad():
            out = getattr(self.module, self.mode)(batch, *self.extra, **self.kwargs)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            return None
        loss = full_tensor(loss) if isinstance(loss, DTensor) else loss
        per_token = [t for t, of_positions in leaves if of_positions]
        grads: list[Optional[Tensor]] = [None] * len(per_token)
        if per_token and loss.requires_grad:
            grads = list(torch.autograd.grad(loss.reshape(()), per_token, allow_unused=True))
        return float(loss.detach()), [
            torch.zeros_like(t) if g is None else g.detach() for t, g in zip(per_token, grads)
        ]


def _leaf(t: Tensor, leaves: list[tuple[Tensor, bool]], of_positions: bool) -> Tensor:
    if not t.is_floating_point():
        return t
    leaf = t.detach().requires_grad_()
    leaves.append((leaf, of_positions))
    return leaf


def _detached(output: Any) -> Any:
    """The network's output as plain tensors without autograd history (a vocabulary-parallel head's split logits
    gathered: the probe's few positions, whole on every tensor-parallel rank)."""
    return map_tensors(lambda t: (full_tensor(t) if isinstance(t, DTensor) else whole_logits(t)).detach())(output)


def _positions(value: Any, chosen: Tensor, length: int) -> tuple[Any, set[int]]:
    """Every tensor of two or more dimensions with ``length`` positions (dimension 1) cut to the ``chosen`` ones, and
    the ids of the cut tensors (what is gathered later: a tensor of another dimension 1 is never taken for one)."""
    index = chosen.to(next(iter(_tensors(value)), chosen).device)
    cut: set[int] = set()

    def select(t: Tensor) -> Tensor:
        if t.dim() < 2 or t.size(1) != length:
            return t
        selected = t.index_select(1, index)
        cut.add(id(selected))
        return selected

    return map_tensors(select)(value), cut


def _tensors(value: Any) -> list[Tensor]:
    found: list[Tensor] = []
    map_tensors(lambda t: found.append(t) or t)(value)
    return found


def _gathered(
    value: Any, of_positions: set[int], shard: ContextShard, average_others: bool = False
) -> tuple[Any, set[int]]:
    """The ranks' ``value`` as one: the tensors whose ids are in ``of_positions`` concatenated along dimension 1 in
    rank order (collective over the context ranks, alike on every one), and their ids; with ``average_others``, the
    network's other floating outputs (a ``labels=`` loss) averaged over the ranks, as the step's loss is; the rest as
    this rank's."""
    gathered: set[int] = set()

    def gather(t: Tensor) -> Tensor:
        if id(t) in of_positions:
            sendable = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()  # gloo gathers no bool
            parts = [torch.empty_like(sendable) for _ in range(shard.size)]
            dist.all_gather(parts, sendable, group=shard.group)
            whole = torch.cat(parts, dim=1).to(t.dtype)
            gathered.add(id(whole))
            return whole
        if average_others and t.is_floating_point():
            total = t.detach().clone()
            dist.all_reduce(total, group=shard.group)
            return total / shard.size
        return t

    return map_tensors(gather)(value), gathered


def _left_out_per_position(grads: list[Tensor], length: int) -> Tensor:
    """Per position of the part: how many samples' outputs the loss does not reach (their gradient is zero)."""
    if not grads:
        return torch.zeros(length, dtype=torch.long)
    reached = None
    for g in grads:
        rows = g.reshape(g.size(0), g.size(1), -1).ne(0).any(dim=2)
        reached = rows if reached is None else reached | rows
    assert reached is not None
    return (~reached).sum(dim=0).cpu()


def _row_norms(g: Tensor) -> Tensor:
    """The norm of each (sample, position) row of a gradient ``[batch, seq, ...]``."""
    return g.double().reshape(g.size(0), g.size(1), -1).norm(dim=2)


def _raise_first(finding: Optional[str]) -> None:
    """Every rank raises the first rank's finding, the same message everywhere (collective over the world: an
    object all-gather)."""
    found = [finding]
    if dist.is_available() and dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, finding)
    first = next((f for f in found if f is not None), None)
    if first is not None:
        raise HybridConfigError(first)


@contextmanager
def _replaced(parent: nn.Module, name: str, stand_in: nn.Module) -> Generator[None, None, None]:
    """``parent``'s child ``name`` is ``stand_in`` meanwhile (setattr: the module's own registration)."""
    previous = getattr(parent, name)
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, previous)


@contextmanager
def _quiet(module: nn.Module) -> Generator[None, None, None]:
    """``self.log`` and ``self.log_dict`` do nothing meanwhile: the probe's values are not the run's."""
    with attribute_replaced(module, "log", _no_log), attribute_replaced(module, "log_dict", _no_log):
        yield


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the probe."""
