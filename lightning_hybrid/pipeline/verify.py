"""No silent wrong pipeline: ``verify_pipeline``, the numeric check of the first training step (the structural
checks are pipeline/checks.py).

``HybridStrategy(verify_pipeline=...)``: on the first batch, one rank compares a fixed random projection of the
network's output on micro-batch 0's inputs, and its gradient norm, pipelined against an unsplit forward and backward
of the same inputs on a copy of the network taken before the cut; none of the user's code runs for it. Costs one
extra pipeline step and one unsplit forward/backward of a micro-batch on one rank, plus that rank's copy of the
network until the end of the first step. ``verify_tensor_parallel`` uses the same machinery without a pipeline.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid._hooks import tensors_in
from lightning_hybrid.agreement import raise_together
from lightning_hybrid.config import AUTO_MAX_PARAMETERS, HybridConfigError, check_verify_pipeline
from lightning_hybrid.dtensor import full_tensor, to_plain
from lightning_hybrid.structure import state_dict_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AUTO_MAX_PARAMETERS",
    "PipelineVerifier",
    "TOLERANCES",
    "check_verify_pipeline",
    "deterministic",
    "make_verifier",
    "projection",
]

TOLERANCES = {"32-true": 1e-4, "64-true": 1e-4}
"""Relative tolerance of the loss and the gradient norm per precision; other (16/bf16) precisions: 5e-2. One
micro-batch through the same operations in another process layout differs by rounding only (about 1e-6 in fp32); a
wrong cut moves the loss or the norm by far more (a stubbed head gives ln(vocab) at every step)."""
LOW_PRECISION_TOLERANCE = 5e-2
LOSS_ERROR_FLOOR = 1.0
"""The loss's error is relative to ``max(|reference loss|, 1)``: absolute for losses under 1, where a sum of
larger terms cancelling to near zero keeps their rounding (the gradient norm stays relative: a wrong cut moves it)."""

VerifySetting = Union[bool, str]


def projection(output: Any) -> Optional[Tensor]:
    """A scalar of a network's output that sees every element: each floating output tensor (made whole) against
    fixed random weights of its shape, the same on every rank and for the copy, divided by the sum of the terms'
    magnitudes (detached). The sum of random-signed terms can cancel to near zero, and its rounding is that of the
    terms, not of the sum: so scaled, the value lies in [-1, 1] and its rounding error is absolute, which the
    comparison's floor of 1 reads correctly (an MoE model's unscaled projection, -0.008, was refused for a
    difference of 1.4e-6 while the gradient norms agreed to 2e-9). None where the output holds no floating tensor.

    Example:
        >>> float(projection(torch.ones(3)).abs()) <= 1.0
        True
    """
    from torch.distributed.tensor import DTensor

    total: Optional[Tensor] = None
    magnitude: Optional[Tensor] = None
    for i, t in enumerate(tensors_in(output)):
        t = to_plain(t) if isinstance(t, DTensor) else t
        if not t.is_floating_point():
            continue
        weights = torch.randn(tuple(t.shape), generator=torch.Generator().manual_seed(i)).to(t.device)
        terms = t.float() * weights
        term, size = terms.sum(), terms.detach().abs().sum()
        total = term if total is None else total + term
        magnitude = size if magnitude is None else magnitude + size
    if total is None or magnitude is None:
        return None
    return total / magnitude.clamp_min(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------------------------------- verify_pipeline
@dataclass
class PipelineVerifier:
    """The unsplit comparison of the first batch (``verify_pipeline``). Every rank takes part in the extra pipeline
    step; the reference rank (the last stage's, first data-parallel replica, first tensor-parallel rank) holds the
    copy of the network, runs it and compares."""

    reference: Optional[nn.Module]
    """The unsplit copy of the network (on the reference rank only)."""
    data_group: Any
    pipeline_group: Any
    tolerance: float
    reference_rank: int = 0
    """Global rank of the reference rank."""
    in_reference_pipeline: bool = False
    """Whether this rank is in the reference rank's pipeline group (first replica, first tensor-parallel rank)."""
    sync: Callable[[], None] = lambda: None
    """Makes the gradients the single-device ones within a replica (tensor-parallel and tied/shared sums)."""
    duplicates: Callable[[], list[nn.Parameter]] = list
    """Copies of shared parameters another pipeline rank owns (counted once, on the owner)."""
    measured: Optional[tuple[float, float]] = None
    """(pipelined loss, pipelined gradient norm) of the verified micro-batch, on the reference rank."""
    option: str = "verify_pipeline"
    """The argument that turned it on, named in its messages (``verify_tensor_parallel`` without a pipeline)."""
    result: Optional[dict[str, float]] = None
    """What the reference rank compared: ``loss``, ``reference_loss``, ``norm``, ``reference_norm``."""
    fingerprint: Optional[Tensor] = None
    """This rank's :func:`weights_fingerprint` of the split network at set-up (None: refresh unconditionally)."""

    def remember(self, network: nn.Module) -> None:
        """Take the split network's fingerprint at set-up, when it holds the weights the copy was taken with."""
        self.fingerprint = weights_fingerprint(network)

    def refresh(self, network: nn.Module) -> None:
        """Load the split network's current weights into the copy (collective: every rank, same order). The copy
        was taken at set-up; a checkpoint resumed since, or a hook, may have changed them. Each stage's parameters
        and buffers are gathered whole over tensor parallel and ZeRO, then sent to the reference rank."""
        if not self._changed_since_setup(network):
            return  # the common case: gathering every weight to the reference rank would be wasted
        mine = {
            state_dict_name(name): full_tensor(t.detach()).cpu()
            for name, t in [*network.named_parameters(), *network.named_buffers()]
        }
        if not self.in_reference_pipeline:
            return
        is_reference = dist.get_rank() == self.reference_rank
        gathered: Optional[list[Any]] = [None] * dist.get_world_size(self.pipeline_group) if is_reference else None
        dist.gather_object(mine, gathered, dst=self.reference_rank, group=self.pipeline_group)
        if not is_reference or self.reference is None:
            return
        state = {k: v for part in gathered or [] for k, v in part.items()}
        own = dict(self.reference.state_dict(keep_vars=True))
        missing = [k for k, v in own.items() if isinstance(v, nn.Parameter) and k not in state]
        if missing:
            import warnings

            # cannot rebuild the unsplit network: no comparison (the structural checks still ran)
            warnings.warn(
                f"{self.option}: no rank holds {missing[:4]}; the unsplit comparison is skipped.", stacklevel=2
            )
            self.reference = None
            return
        self.reference.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
        with torch.no_grad():  # non-persistent buffers (rotary tables) are in no state dict; a copy built on the meta
            for name, buffer in self.reference.named_buffers():  # device has no values for them yet
                if name not in own and name in state:
                    buffer.copy_(state[name])

    def _changed_since_setup(self, network: nn.Module) -> bool:
        """Whether any rank's weights differ from its set-up fingerprint (collective over the world: one all-reduce
        of a flag, so that every rank takes the same branch)."""
        now = weights_fingerprint(network)
        before = self.fingerprint
        same = before is not None and now is not None and torch.allclose(now, before, rtol=1e-9, atol=0.0)
        device = next((t.device for t in [*network.parameters(), *network.buffers()]), torch.device("cpu"))
        changed = torch.tensor([0.0 if same else 1.0], device=device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        return bool(changed.item())

    def common_microbatch(self, microbatch: Any) -> Any:
        """The first data-parallel replica's micro-batch, on every replica (so their gradients agree)."""
        if dist.get_world_size(self.data_group) == 1:
            return microbatch
        payload = [microbatch if dist.get_rank(self.data_group) == 0 else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(self.data_group, 0), group=self.data_group)
        return _to_device_like(payload[0], microbatch)

    def gradient_norm(self, module: nn.Module) -> float:
        """The norm of the gradient the pipeline produced (collective: every rank, same parameter order)."""
        from torch.distributed.tensor import DTensor

        self.sync()
        skip = {id(p) for p in self.duplicates()}
        total = torch.zeros((), dtype=torch.float64)
        seen: set[int] = set()
        for p in module.parameters():
            if id(p) in seen or p.grad is None:
                continue
            seen.add(id(p))
            g = p.grad
            if isinstance(p, DTensor) and not isinstance(g, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            g = full_tensor(g)
            if id(p) not in skip:
                total += g.detach().double().pow(2).sum().cpu()
        device = next(module.parameters()).device
        total = total.to(device)
        dist.all_reduce(total, group=self.pipeline_group)
        return math.sqrt(float(total))

    def reference_values(self, value: Callable[[], Tensor]) -> tuple[float, float]:
        """The projection ``value()`` of the unsplit copy's output on the verified inputs, and its gradient norm over
        the copy's parameters."""
        assert self.reference is not None
        loss = value()
        # the verified inputs are detached: only the copy's parameters get gradients, as in the pipelined check
        params = list({id(p): p for p in self.reference.parameters()}.values())
        grads = torch.autograd.grad(loss, [p for p in params if p.requires_grad], allow_unused=True)
        norm = math.sqrt(sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None))
        return float(loss.detach()), norm

    def compare(self, reference: Optional[tuple[float, float]]) -> None:
        """Every rank raises if the reference rank found a mismatch (collective over the world)."""
        with raise_together():
            if reference is None:
                return
            assert self.measured is not None
            (loss, norm), (ref_loss, ref_norm) = self.measured, reference
            self.result = {"loss": loss, "reference_loss": ref_loss, "norm": norm, "reference_norm": ref_norm}
            # a loss near zero is a cancellation of larger terms, whose rounding does not shrink with it (an MoE
            # model's loss of -0.008 differed by 1.4e-6 at tp2 with equal gradients): below 1 the error is absolute
            if not all(math.isfinite(v) for v in (loss, ref_loss, norm, ref_norm)):
                where = "the unsplit copy's too" if not math.isfinite(ref_loss + ref_norm) else "the split network's"
                raise HybridConfigError(
                    f"`{self.option}`: the weights or gradients hold NaN or Inf ({where}: value {loss:.6g} vs"
                    f" {ref_loss:.6g}, gradient norm {norm:.6g} vs {ref_norm:.6g}), so the first step cannot be"
                    " checked: look at the initialization or the checkpoint the weights came from (a NaN in the"
                    f" weights trains NaN on one device too), or pass `{self.option}=False`."
                )
            loss_err = abs(loss - ref_loss) / max(abs(ref_loss), LOSS_ERROR_FLOOR)
            norm_err = abs(norm - ref_norm) / max(abs(ref_norm), 1e-12)
            if not (loss_err <= self.tolerance and norm_err <= self.tolerance):
                pipeline = self.option == "verify_pipeline"
                cause = (
                    "The stage cut does not fit this network's forward (a module read on a stage that does not hold"
                    " it?); train it without pipeline parallel"
                    if pipeline
                    else "The tensor-parallel plan does not fit this network's forward (a fused projection whose parts"
                    " it splits wrong, or a gradient summed where it is whole?); pass `tensor_parallel_plan` as a dict"
                    " that leaves the doubtful layers replicated, or train it with data or pipeline parallel"
                )
                raise HybridConfigError(
                    f"`{self.option}`: the {'pipelined' if pipeline else 'tensor-parallel'} network does not match an"
                    " unsplit forward of the same network on the first micro-batch's inputs (a fixed random projection"
                    f" of its output): value {loss:.6g} vs {ref_loss:.6g} (error"
                    f" {loss_err:.1e}), gradient norm {norm:.6g} vs {ref_norm:.6g} ({norm_err:.1e}); tolerance"
                    f" {self.tolerance:g}. {cause}, or pass `{self.option}=False` only if you know why they differ."
                )
        self.reference = None  # the copy is not needed after the first step

    @contextmanager
    def deterministic(self, *modules: Optional[nn.Module]) -> Generator[None, None, None]:
        """Both sides in eval mode (no dropout), and the random state put back (:func:`deterministic`)."""
        with deterministic(*modules):
            yield


@contextmanager
def deterministic(*modules: Optional[nn.Module]) -> Generator[None, None, None]:
    """``modules`` in eval mode (no dropout), and the random state put back: a checked step leaves the run as it would
    have been without it."""
    flags = [(m, m.training) for module in modules if module is not None for m in module.modules()]
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)


def weights_fingerprint(network: nn.Module) -> Optional[Tensor]:
    """Three float64 sums per local tensor (of the values, of their squares, and of every other value, which a
    shuffle moves) of every parameter and buffer this rank holds, on the CPU; None where a tensor has no data (the
    meta device). Equal fingerprints within 1e-9 mean the weights did not change: a checkpoint load or an edit moves
    them by far more, and the tolerance absorbs only a different summation order (the model moved to its device
    meanwhile). Accumulated in float64 without a float64 copy of any tensor."""
    from torch.distributed.tensor import DTensor

    sums = []
    for t in [*network.parameters(), *network.buffers()]:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.is_meta:
            return None
        flat = t.detach().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        f64 = torch.float64
        sums.append(torch.stack([flat.sum(dtype=f64), flat.square().sum(dtype=f64), flat[::2].sum(dtype=f64)]))
    return torch.stack(sums).cpu() if sums else torch.zeros(0, 3, dtype=torch.float64)


def _to_device_like(obj: Any, like: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    device = next((t.device for t in tensors_in(like)), None)
    return obj if device is None else apply_to_collection(obj, Tensor, lambda t: t.to(device))


def make_verifier(
    setting: VerifySetting,
    module: nn.Module,
    network: nn.Module,
    mesh: DeviceMesh,
    *,
    precision: str,
    last_stage_rank: int,
    option: str = "verify_pipeline",
    shared: tuple[Any, ...] = (),
) -> Optional[PipelineVerifier]:
    """The verifier for ``verify_pipeline=setting``, or None when it is off. Call before the network is cut (the
    reference rank copies it then); ``last_stage_rank`` is the pipeline rank that holds the last stage; ``shared``:
    objects the copy shares rather than copies (what the LightningModule is attached to: its trainer and mesh).

    ``"auto"`` is on for fp32 training of a model of at most :data:`AUTO_MAX_PARAMETERS` parameters whose
    ``configure_model`` did not already split it (a split copy could not run unsplit on one rank); ``True`` refuses
    the latter instead.

    Example:
        >>> # verifier = make_verifier("auto", module, module.model, mesh, precision="32-true", last_stage_rank=1)
    """
    from torch.distributed.tensor import DTensor

    check_verify_pipeline(setting, option)
    if setting is False:
        return None
    user_split = any(isinstance(p, DTensor) for p in module.parameters())
    size = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    if setting == "auto" and (user_split or size > AUTO_MAX_PARAMETERS or precision not in TOLERANCES):
        return None
    coordinates = {name: mesh[name].get_local_rank() for name in ("pipeline", "data", "tensor")}
    is_reference = coordinates == {"pipeline": last_stage_rank, "data": 0, "tensor": 0}
    reference_rank = int(mesh.mesh[last_stage_rank, 0, 0])
    # the LightningModule may be the network: what it is attached to (its trainer and mesh) is shared, not copied
    memo = {id(v): v for v in shared if v}
    return PipelineVerifier(
        reference=copy.deepcopy(network, memo) if is_reference else None,
        data_group=mesh["data"].get_group(),
        pipeline_group=mesh["pipeline"].get_group(),
        tolerance=TOLERANCES.get(precision, LOW_PRECISION_TOLERANCE),
        reference_rank=reference_rank,
        in_reference_pipeline=coordinates["data"] == 0 and coordinates["tensor"] == 0,
        option=option,
    )
