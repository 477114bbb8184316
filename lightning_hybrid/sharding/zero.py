"""ZeRO over the data-parallel dimension.

Stage 3 is FSDP2 (``fully_shard``) on the data mesh: torch's implementation composes with DTensor tensor parallel and
with ``torch.distributed.pipelining``. Stages 0-2 keep whole parameters on every replica, which FSDP2 cannot express
and ``ZeroRedundancyOptimizer`` cannot do for DTensor parameters or evenly (it shards whole tensors), so they are
written here, in the flat-buffer form DeepSpeed and Megatron's distributed optimizer use:

* gradients are reduced once per optimizer step, after all micro-batches (stage 0: all-reduce; stage 1/2:
  reduce-scatter into the rank's shard, so with the all-gather after the step a ZeRO step moves what one DDP
  all-reduce moves; stage 1 keeps the full-size gradient buffer until the step, stage 2 frees it at once);
* stage 0 without master weights (and without a pipeline, whose schedule runs its own backward passes) can instead
  reduce in gradient buckets during the step's last backward pass, overlapping communication with the rest of the
  backward pass as DDP does (:class:`GradientBuckets`);
* stage 1/2: each rank owns ``1/dp`` of a flat copy of every parameter group, the user's optimizer object is kept
  (so LR schedulers and hyper-parameters keep working) but steps only that shard; the updated shards are all-gathered
  back into the model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_hybrid._torch_compat import is_strided_shard, queue_autograd_callback
from lightning_hybrid.dtensor import like, local_bytes, local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GradientBuckets",
    "GradientSync",
    "ShardedGradientBuckets",
    "ShardedOptimizer",
    "apply_fully_shard",
    "check_user_sharding",
    "local_grad",
    "local_tensor",
    "user_fully_sharded",
]


def _reduce_scatter(output: Tensor, input: Tensor, group: Any) -> None:
    # torch 2.13 renamed the flat collectives; 2.11/2.12 only have the old names (looked up per call, so tools that
    # wrap torch.distributed, like the tests' collective counter, see them)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)


def _all_gather(output: Tensor, input: Tensor, group: Any) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def local_grad(p: nn.Parameter) -> Optional[Tensor]:
    """This rank's gradient storage for ``p``, laid out like ``p``'s own local tensor.

    With ``-true`` precisions this is the parameter's fp32 ``main_grad`` view (see :class:`ShardedOptimizer`).
    DTensor autograd may leave a gradient in another placement than its parameter (a vocab-parallel embedding's
    gradient comes back Replicate); redistributing it to the parameter's placement first keeps flat offsets aligned.
    """
    main = getattr(p, "main_grad", None)
    if main is not None:
        return main  # low-precision parameters accumulate into an fp32 buffer (ShardedOptimizer with masters)
    return _autograd_local_grad(p)


def _autograd_local_grad(p: nn.Parameter) -> Optional[Tensor]:
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


def _all_reduce_mean(flat: Tensor, group: Any, size: int) -> None:
    # ReduceOp.AVG is nccl-only; SUM then divide works on every backend
    dist.all_reduce(flat, group=group)
    flat.div_(size)


def _flat_grads(params: list[nn.Parameter], pad_to: int = 0) -> Tensor:
    pieces = [
        g.reshape(-1) if (g := local_grad(p)) is not None else local_tensor(p).new_zeros(local_tensor(p).numel())
        for p in params
    ]
    flat = torch.cat(pieces) if pieces else torch.zeros(0)
    if pad_to > flat.numel():
        flat = torch.cat([flat, flat.new_zeros(pad_to - flat.numel())])
    return flat


class GradientSync:
    """Makes gradients of parameters that tensor parallel left replicated consistent across the tensor group.

    ``pairs`` are (parameter name, "avg" | "sum"): "sum" where each tensor-parallel rank computed a partial gradient
    (a replicated weight inside a split attention/MLP), "avg" where every rank computed the full one.
    """

    def __init__(
        self,
        module: nn.Module,
        pairs: list[tuple[str, str]],
        tp_mesh: Optional[DeviceMesh],
        dp_replicated: Optional[list[str]] = None,
        dp_mesh: Optional[DeviceMesh] = None,
    ) -> None:
        self.tp_mesh, self.dp_mesh = tp_mesh, dp_mesh
        named = dict(module.named_parameters())
        self.buckets = {op: [named[n] for n, o in pairs if o == op and n in named] for op in ("avg", "sum")}
        self.dp_replicated = [named[n] for n in dp_replicated or []]

    def __call__(self) -> None:
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            params = [p for p in self.dp_replicated if local_grad(p) is not None]
            if params:
                flat = _flat_grads(params)
                _all_reduce_mean(flat, self.dp_mesh.get_group(), self.dp_mesh.size())
                _unflatten_into([local_grad(p) for p in params], flat)
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return
        group = self.tp_mesh.get_group()
        for op, params in self.buckets.items():
            params = [p for p in params if local_grad(p) is not None]
            if not params:
                continue
            flat = _flat_grads(params)
            if op == "avg":
                _all_reduce_mean(flat, group, self.tp_mesh.size())
            else:
                dist.all_reduce(flat, group=group)
            _unflatten_into([local_grad(p) for p in params], flat)

    @torch.no_grad()
    def sync_views(self, params: list[nn.Parameter], views: list[Tensor]) -> None:
        """The tensor-parallel part of :meth:`__call__` on gradients held elsewhere than ``p.grad``: ``views[i]`` is
        ``params[i]``'s (flat) gradient, e.g. in a ZeRO-2 bucket before its data-parallel reduction. All ranks of a
        tensor-parallel group must pass the same parameters in the same order."""
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return
        group = self.tp_mesh.get_group()
        for op, members in self.buckets.items():
            ids = {id(p) for p in members}
            chosen = [v for p, v in zip(params, views) if id(p) in ids]
            if not chosen:
                continue
            flat = torch.cat([v.reshape(-1) for v in chosen])
            if op == "avg":
                _all_reduce_mean(flat, group, self.tp_mesh.size())
            else:
                dist.all_reduce(flat, group=group)
            _unflatten_into(chosen, flat)


def _unflatten_into(targets: list[Tensor], flat: Tensor) -> None:
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _as_grad(p: nn.Parameter, view: Tensor) -> Tensor:
    """What ``p.grad`` is set to so that it stores into ``view``: the view, or for a DTensor parameter a DTensor of
    the parameter's mesh and placements whose local tensor is the view."""
    with torch.no_grad():
        return like(view, p)


class _Bucket:
    """The gradients of consecutive parameters in one flat buffer, all-reduced by one asynchronous collective."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        shapes = [local_tensor(p).shape for p in params]
        numel = sum(local_tensor(p).numel() for p in params)
        first = local_tensor(params[0])
        # after the gradients, one element per parameter: 1 where this rank produced the parameter's gradient. Reduced
        # with them, it says which parameters no rank used: their gradient stays None (as in DDP), so the optimizer
        # skips them as it would on one device (weight decay included)
        self.buffer = torch.zeros(numel + len(params), dtype=first.dtype, device=first.device)
        self.used = self.buffer[numel:]
        self.views: list[Tensor] = []
        offset = 0
        for shape, p in zip(shapes, params):
            n = local_tensor(p).numel()
            self.views.append(self.buffer[offset : offset + n].view(shape))
            offset += n
        self.grads = [_as_grad(p, v) for p, v in zip(params, self.views)]
        self.reported: set[int] = set()  # parameters whose gradient arrived in the step's last backward pass
        self.handle: Any = None
        self.launched_in_backward = 0  # all-reduces started from a gradient hook, before the backward pass ended
        self.launches = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class _InOrderLaunch:
    """What both kinds of gradient buckets share: a bucket starts once every parameter in it has reported its
    gradient, strictly in bucket order (the same on every rank, so the collectives match), and when the backward pass
    ends, whatever is left starts (``_end_of_backward``)."""

    buckets: list[Any]
    _next: int
    _callback_queued: bool
    _hooks: list[Any]  # each parameter's post-accumulate-grad hook handle

    def remove_hooks(self) -> None:
        """Stop receiving gradients (the optimizer is being replaced)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _launch(self, b: Any, *, in_backward: bool) -> None:
        raise NotImplementedError

    def _end_of_backward(self) -> None:
        raise NotImplementedError

    def _report(self, b: Any, i: int) -> None:
        if not self._callback_queued:
            # like DDP: when the backward pass ends, start what is left and wait for everything
            queue_autograd_callback(self._end_of_backward)
            self._callback_queued = True
        b.reported.add(i)
        while self._next < len(self.buckets) and len(self.buckets[self._next].reported) == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next], in_backward=True)


class GradientBuckets(_InOrderLaunch):
    """Data-parallel gradient averaging in buckets, overlapped with the backward pass (ZeRO-0), as torch's DDP and
    Megatron's distributed data parallel do it.

    Written by hand because torch's ``DistributedDataParallel`` cannot wrap DTensor (tensor-parallel) parameters and
    does not compose with this package's ZeRO and pipeline code; the design is DDP's:

    * parameters are put in buckets of about ``bucket_cap_mb`` in reverse order (the order backward produces their
      gradients; the first bucket is at most 1 MiB, as DDP's, so communication starts early), each bucket one flat
      buffer;
    * a post-accumulate-grad hook copies a parameter's gradient into its place in the buffer and makes ``p.grad`` a
      view of it, so later backward passes of the step (gradient accumulation) add into the buffer in place;
    * during the step's last backward pass (:meth:`arm`), once every parameter of a bucket has reported, the bucket's
      ``all_reduce(async_op=True)`` starts while backward continues. Buckets start strictly in order on every rank
      (bucket ``k`` only after buckets ``< k``), so the collectives match across ranks even when a parameter gets no
      gradient on some rank; the rest start when the backward pass ends, which then waits for all of them and
      divides by the data-parallel size. ``p.grad`` stays a view of the buffer: no copy back.

    Example:
        >>> # buckets = GradientBuckets(params, group=dp_group, dp=2, bucket_cap_mb=25)
        >>> # buckets.arm(); loss.backward()   # reduced (averaged) when backward returns
        >>> # buckets.reduce()                  # for a step whose backward ran unarmed (manual optimization)
    """

    FIRST_BUCKET_BYTES = 2**20

    def __init__(self, params: list[nn.Parameter], *, group: Any, dp: int, bucket_cap_mb: float) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.group, self.dp = group, dp
        cap = int(bucket_cap_mb * 2**20)
        limit = min(cap, self.FIRST_BUCKET_BYTES)
        groups: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            local = local_tensor(p)
            if current and (local.dtype, local.device) != (
                local_tensor(current[0]).dtype,
                local_tensor(current[0]).device,
            ):
                groups.append(current)
                current, size, limit = [], 0, cap
            current.append(p)
            size += local.numel() * local.element_size()
            if size >= limit:  # DDP's rule: a bucket closes once it reaches the cap (a larger parameter fills one)
                groups.append(current)
                current, size, limit = [], 0, cap
        if current:
            groups.append(current)
        self.buckets = [_Bucket(i, ps) for i, ps in enumerate(groups)]
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.armed = False
        self._next = 0  # the next bucket to start
        self._done = False  # reduced at the end of the armed backward pass
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def arm(self) -> None:
        """The next backward pass is the step's last: start each bucket's all-reduce as soon as it is complete."""
        self.armed, self._done, self._callback_queued = True, False, False

    @torch.no_grad()
    def _adopt(self, b: _Bucket, i: int, p: nn.Parameter) -> bool:
        """Make the bucket hold ``p``'s whole gradient (``p.grad`` a view of it). False when ``p`` has none."""
        g = _autograd_local_grad(p)
        if g is None:
            return False
        view = b.views[i]
        if g.data_ptr() != view.data_ptr() or g.numel() != view.numel():
            # a fresh gradient (the first backward pass after zero_grad), or one replaced by user code: it is the
            # whole accumulated gradient, since autograd adds into whatever p.grad held
            view.copy_(g)
            p.grad = b.grads[i]
        return True

    def _on_gradient(self, p: nn.Parameter) -> None:
        b, i = self._slot[id(p)]
        if b.handle is not None:
            raise RuntimeError(
                "A parameter's gradient was accumulated again after its bucket's all-reduce had started (the"
                " parameter takes part in two backward graphs of one pass, e.g. reentrant activation checkpointing)."
                " Use non-reentrant checkpointing, or HybridStrategy(overlap_grad_reduce=False)."
            )
        self._adopt(b, i, p)
        if not self.armed:
            return  # an accumulation pass (under block_backward_sync) or manual optimization: reduce at the step
        self._report(b, i)

    @torch.no_grad()
    def _launch(self, b: _Bucket, *, in_backward: bool) -> None:
        if in_backward:
            b.used.fill_(1)  # every parameter of the bucket reported
        else:
            used = [i in b.reported or self._adopt(b, i, p) for i, p in enumerate(b.params)]
            for i, flag in enumerate(used):
                if not flag:
                    b.views[i].zero_()  # no gradient on this rank: contribute zeros
            b.used.copy_(torch.tensor(used, dtype=b.used.dtype))
        b.handle = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        b.launches += 1
        b.launched_in_backward += int(in_backward)
        self._next += 1

    def _end_of_backward(self) -> None:
        self._finish()
        self._done = True

    @torch.no_grad()
    def _finish(self) -> None:
        for b in self.buckets[self._next :]:
            self._launch(b, in_backward=False)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.buffer.div_(self.dp)  # ReduceOp.AVG is nccl-only
        # one read of every bucket's flags (a single device-to-host sync on GPUs)
        used = torch.cat([b.used for b in self.buckets]).tolist()
        k = 0
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if used[k + i] > 0:
                    if p.grad is not b.grads[i]:
                        p.grad = b.grads[i]
                else:
                    p.grad = None  # no rank produced a gradient: as on one device, the optimizer skips it
            k += len(b.params)
            b.reported.clear()
        self._next = 0
        self.armed = False

    def reduce(self) -> None:
        """Average the gradients over the data-parallel group, if the armed backward pass has not done it already."""
        if not self._done:
            self._finish()
        self._done = False

    def reset(self) -> None:
        """Forget the step (a skipped step, or an error inside it): nothing in flight, nothing reported."""
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.reported.clear()
        self._next, self.armed, self._done = 0, False, False

    def stats(self) -> list[dict[str, int]]:
        """Per bucket: parameters, bytes, all-reduces started, and how many of those started inside backward."""
        return [
            {"params": len(b.params), "bytes": b.nbytes, "launches": b.launches, "in_backward": b.launched_in_backward}
            for b in self.buckets
        ]


def _nominal_bytes(p: nn.Parameter) -> int:
    """Bytes of ``p``'s local tensor as every tensor-parallel rank computes it alike (the global size over the number
    of shards): bucket boundaries drawn from it are the same on all those ranks, so per-bucket tensor-parallel
    collectives match even where an uneven split would give ranks different local sizes."""
    local = local_tensor(p)
    if not isinstance(p, DTensor):
        return local.numel() * local.element_size()
    shards = 1
    for dim, placement in enumerate(p.placements):
        if not placement.is_replicate() and not placement.is_partial():
            shards *= p.device_mesh.size(dim)
    return p.numel() // shards * local.element_size()


class _ShardBucket:
    """Parameters that come one after another in backward order (of any optimizer group), reduced to the owners of
    their elements (the data-parallel ranks whose shards hold them) once every one of them has reported.

    The buffer is laid out by owner: rank 0's pieces first, then rank 1's, ..., and within an owner by flat group and
    flat offset, so the bucket is one ``dist.reduce`` per owner whatever groups its parameters come from, and each
    owner adds a few contiguous runs into its shard. (Cutting buckets at every change of optimizer group instead gave
    the example's decay / no-decay groups 35 buckets of one to three parameters: 35 collectives per backward pass.)"""

    def __init__(self, index: int, members: list[tuple[nn.Parameter, int, int]], shards: list[int]) -> None:
        # members: (parameter, flat group, flat offset) in backward order; shards: each group's shard size
        self.index = index
        self.params = [p for p, _, _ in members]
        cut = []  # (owner, group, flat lo, flat hi, parameter index, offset in the parameter)
        for i, (p, g, offset) in enumerate(members):
            lo, end = offset, offset + local_tensor(p).numel()
            while lo < end:  # a parameter across a shard boundary has a piece on each side
                q = lo // shards[g]
                hi = min(end, (q + 1) * shards[g])
                cut.append((q, g, lo, hi, i, lo - offset))
                lo = hi
        cut.sort(key=lambda c: c[:3])
        self.slots: list[list[tuple[int, int, int]]] = [[] for _ in members]  # per parameter: (at, offset, length)
        self.runs: list[list[int]] = []  # [owner, group, flat lo, flat hi, at]: contiguous in the buffer and the shard
        self.owners: list[tuple[int, int, int]] = []  # (owner, lo, hi) in the buffer: one reduction each
        at = 0
        for q, g, lo, hi, i, offset in cut:
            self.slots[i].append((at, offset, hi - lo))
            run = self.runs[-1] if self.runs else None
            if run is not None and run[:2] == [q, g] and run[3] == lo:
                run[3] = hi
            else:
                self.runs.append([q, g, lo, hi, at])
            if self.owners and self.owners[-1][0] == q:
                self.owners[-1] = (q, self.owners[-1][1], at + hi - lo)
            else:
                self.owners.append((q, at, at + hi - lo))
            at += hi - lo
        self.numel = at
        # what the tensor-parallel sync reads: each parameter's pieces, parameter by parameter, in element order
        self._sync_order = [
            (p, a, n) for p, slots in zip(self.params, self.slots) for a, _, n in sorted(slots, key=lambda s: s[1])
        ]
        self.buffer: Optional[Tensor] = None  # allocated when the pass's first gradient arrives, freed once reduced
        self.reported: set[int] = set()
        self.handles: list[Any] = []
        self.launches = 0
        self.launched_in_backward = 0

    def views(self, buffer: Tensor) -> tuple[list[nn.Parameter], list[Tensor]]:
        """Each parameter's gradient in ``buffer`` as its pieces, parameter by parameter and in element order (a
        parameter across a shard boundary is listed once per piece): what the tensor-parallel sync reads."""
        return [p for p, _, _ in self._sync_order], [buffer[at : at + n] for _, at, n in self._sync_order]


class ShardedGradientBuckets(_InOrderLaunch):
    """ZeRO-2 gradient reduction in buckets during every backward pass, so that no rank holds more than its gradient
    shard plus the buckets in flight (DeepSpeed's stage 2 design, with DDP's bucket order):

    * the parameters, in the order backward produces their gradients (the model's, reversed), are cut into buckets
      of whole parameters of about ``bucket_cap_mb`` (the first at most 1 MiB), across optimizer groups; each
      group's flat buffer keeps the ZeRO-1/2 layout (rank ``d`` owns its contiguous slice ``d``), and a bucket's
      buffer is its parameters' pieces ordered by the rank that owns them;
    * a post-accumulate-grad hook adds a parameter's gradient into its bucket (in the shard's dtype: fp32 under
      '-true' precisions) and frees autograd's tensor (``p.grad = None``);
    * once every parameter of the next bucket has reported, its pieces are reduced, asynchronously, to the ranks
      whose shards hold them (``dist.reduce``: one collective per owner, at most dp per bucket). Buckets start in
      order on every rank; at most ``MAX_IN_FLIGHT`` are in flight: starting one more first waits for the oldest,
      which its owner adds into its shard accumulator and every rank frees. The rest start when backward ends. So
      a rank holds its shard plus at most ``MAX_IN_FLIGHT + 1`` bucket buffers (those in flight and the one
      filling) and autograd's gradient of the parameter being added;
    * every backward pass reduces, gradient-accumulation passes included, and adds into the shard accumulator (as
      DeepSpeed's stage 2 does): keeping the full gradient between micro-batches would be ZeRO-1's memory.
      :meth:`take` hands the accumulated shard to the optimizer at the step.

    A dist.reduce to the owner keeps the shard layout of stage 1 (and of checkpoints); a reduce-scatter per bucket
    would give each rank a slice of every bucket instead (Megatron's layout).

    ``tensor_sync``: the :class:`GradientSync` of tensor-parallel replicated parameters, run on each bucket before it
    is reduced (the full gradients are gone after backward; the sync is linear, so per micro-batch is exact).
    ``parameter_order``: the model's parameters in registration order (``module.parameters()``), whose reverse is
    the order backward produces their gradients; by default the optimizer groups' order.

    Example:
        >>> # buckets = ShardedGradientBuckets(zero.groups, group=dp_group, dp=2, dp_rank=0, bucket_cap_mb=25)
        >>> # loss.backward()                 # buckets reduced to their owners as backward runs
        >>> # shard = buckets.take(0)         # the accumulated (summed, not yet averaged) shard of group 0
    """

    FIRST_BUCKET_BYTES = 2**20
    MAX_IN_FLIGHT = 2

    def __init__(
        self,
        groups: list[_FlatGroup],
        *,
        group: Any,
        dp: int,
        dp_rank: int,
        bucket_cap_mb: float,
        dtype: Optional[torch.dtype] = None,
        tensor_sync: Optional[GradientSync] = None,
        parameter_order: Optional[list[nn.Parameter]] = None,
        host_copies: bool = False,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.group, self.dp, self.dp_rank, self.tensor_sync = group, dp, dp_rank, tensor_sync
        self.flat_groups = groups
        cap = int(bucket_cap_mb * 2**20)
        limit = min(cap, self.FIRST_BUCKET_BYTES)
        where: dict[int, tuple[int, int]] = {}  # parameter -> (flat group, flat offset)
        for gi, g in enumerate(groups):
            offset = 0
            for p in g.params:
                where[id(p)] = (gi, offset)
                offset += local_tensor(p).numel()
        shards = [g.shard_size for g in groups]
        # the model's order, reversed, is the order backward produces gradients; a bucket is a run of it, whichever
        # optimizer groups (decay / no decay) its parameters belong to
        known = {id(p) for p in parameter_order or []}
        order = [p for g in groups for p in g.params if id(p) not in known]  # not in the model: reported last
        order += [p for p in dict.fromkeys(parameter_order or []) if id(p) in where]
        self.buckets: list[_ShardBucket] = []
        current: list[tuple[nn.Parameter, int, int]] = []
        size = 0
        for p in reversed(order):
            current.append((p, *where[id(p)]))
            size += _nominal_bytes(p)
            if size >= limit:  # DDP's rule: a bucket closes once it reaches the cap (a larger parameter fills one)
                self.buckets.append(_ShardBucket(len(self.buckets), current, shards))
                current, size, limit = [], 0, cap
        if current:
            self.buckets.append(_ShardBucket(len(self.buckets), current, shards))
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        first = next((p for g in groups for p in g.params), None)
        self.dtype = dtype or (local_tensor(first).dtype if first is not None else torch.float32)
        self.device = local_tensor(first).device if first is not None else torch.device("cpu")
        self._accumulators: list[Optional[Tensor]] = [None] * len(groups)
        self._next = 0
        self._in_flight: list[_ShardBucket] = []
        self._callback_queued = False
        self.passes = 0  # backward passes reduced (one per micro-batch)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self._slot_params()]
        # optimizer offload on an accelerator: during the step's last backward pass (armed), each settled bucket's
        # piece of this rank's shard is copied into pinned host memory at once, overlapping the rest of backward
        self._host: Optional[list[Tensor]] = None
        if host_copies and self.device.type != "cpu":
            self._host = [torch.zeros(g.shard_size, dtype=self.dtype, pin_memory=True) for g in groups]
        self._owned = [0] * len(groups)  # elements of this rank's shard that the buckets cover, per group
        for b in self.buckets:
            for q, g, lo, hi, _ in b.runs:
                if q == dp_rank:
                    self._owned[g] += hi - lo
        self._copied = [0] * len(groups)
        self._armed = False

    def _slot_params(self) -> list[nn.Parameter]:
        return list({id(p): p for b in self.buckets for p in b.params}.values())

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket's buffer while it is in use."""
        return [b.numel * torch.empty((), dtype=self.dtype).element_size() for b in self.buckets]

    def arm(self) -> None:
        """The next backward pass is the step's last. Every pass reduces (see the class notes); with host copies
        (offload), this one also copies each settled piece of the shard to host memory as it goes."""
        self._armed = True
        self._copied = [0] * len(self.flat_groups)

    def _buffer(self, b: _ShardBucket) -> Tensor:
        if b.buffer is None:
            b.buffer = torch.zeros(b.numel, dtype=self.dtype, device=self.device)
        return b.buffer

    @torch.no_grad()
    def _on_gradient(self, p: nn.Parameter) -> None:
        b, i = self._slot[id(p)]
        if b.handles:
            raise RuntimeError(
                "A parameter's gradient was accumulated again after its bucket's reduction had started (the"
                " parameter takes part in two backward graphs of one pass, e.g. reentrant activation checkpointing)."
                " Use non-reentrant checkpointing, or HybridStrategy(overlap_grad_reduce=False)."
            )
        g = _autograd_local_grad(p)
        if g is None:
            return
        flat, buffer = g.reshape(-1), self._buffer(b)
        for at, offset, n in b.slots[i]:  # casts to the shard's dtype (fp32 under '-true' precisions)
            buffer[at : at + n].add_(flat[offset : offset + n])
        p.grad = None  # the bucket holds it now: autograd's tensor is freed at once
        self._report(b, i)

    @torch.no_grad()
    def _launch(self, b: _ShardBucket, *, in_backward: bool) -> None:
        while len(self._in_flight) >= self.MAX_IN_FLIGHT:  # bound the memory: the oldest finishes first
            self._settle(self._in_flight.pop(0))
        buffer = self._buffer(b)  # a parameter that got no gradient on this rank contributes zeros
        if self.tensor_sync is not None:
            self.tensor_sync.sync_views(*b.views(buffer))
        for q, lo, hi in b.owners:
            dst = dist.get_global_rank(self.group, q)
            b.handles.append(dist.reduce(buffer[lo:hi], dst, group=self.group, async_op=True))
        b.launches += 1
        b.launched_in_backward += int(in_backward)
        self._next += 1
        self._in_flight.append(b)

    def _settle(self, b: _ShardBucket) -> None:
        """Wait for the bucket's reductions; the owner adds its piece into its shard; the buffer is freed."""
        for handle in b.handles:
            handle.wait()
        b.handles = []
        for q, g, lo, hi, at in b.runs:
            if q == self.dp_rank and b.buffer is not None:
                shard = self.flat_groups[g].shard_size
                base = self.dp_rank * shard
                acc = self._accumulators[g]
                if acc is None:
                    acc = self._accumulators[g] = torch.zeros(shard, dtype=self.dtype, device=self.device)
                acc[lo - base : hi - base].add_(b.buffer[at : at + hi - lo])
                if self._host is not None and self._armed:  # final for this step: to host memory, not waited for
                    self._host[g][lo - base : hi - base].copy_(acc[lo - base : hi - base], non_blocking=True)
                    self._copied[g] += hi - lo
        b.buffer = None
        b.reported.clear()

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        for b in self.buckets[self._next :]:
            self._launch(b, in_backward=False)
        while self._in_flight:
            self._settle(self._in_flight.pop(0))
        self._next, self._callback_queued, self._armed = 0, False, False
        self.passes += 1

    def accumulated(self, index: int) -> Optional[Tensor]:
        """The shard of flat group ``index`` accumulated so far this step (None before the first backward pass)."""
        return self._accumulators[index]

    def take(self, index: int) -> Tensor:
        """The shard of flat group ``index`` summed over the data-parallel ranks and over every backward pass since
        the last call (zeros if none ran); the buckets start accumulating a new one."""
        acc = self._accumulators[index]
        self._accumulators[index] = None
        if self._host is not None and acc is not None and self._copied[index] == self._owned[index]:
            # the last backward pass copied every piece to host memory already: wait for those copies only
            self._copied[index] = 0
            torch.cuda.current_stream(self.device).synchronize()
            return self._host[index]
        if acc is None:
            acc = torch.zeros(self.flat_groups[index].shard_size, dtype=self.dtype, device=self.device)
        return acc

    def reset(self) -> None:
        """Forget the step (a skipped step, or an error inside it): nothing in flight, nothing accumulated."""
        for b in self.buckets:
            for handle in b.handles:
                handle.wait()
            b.handles, b.buffer = [], None
            b.reported.clear()
        self._in_flight, self._next, self._callback_queued, self._armed = [], 0, False, False
        self._accumulators = [None] * len(self.flat_groups)
        self._copied = [0] * len(self.flat_groups)

    def stats(self) -> list[dict[str, int]]:
        """Per bucket: parameters, bytes, reductions started (one per backward pass) and how many started inside
        backward."""
        return [
            {"params": len(b.params), "bytes": n, "launches": b.launches, "in_backward": b.launched_in_backward}
            for b, n in zip(self.buckets, self.bucket_bytes)
        ]


@dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    numel: int
    shard_size: int  # elements of the flat group this rank steps (all of them when not sharded)
    master: Optional[nn.Parameter]  # the master copy of those elements (stage 1/2, or low-precision parameters)
    grad_buffer: Optional[Tensor] = None  # fp32 gradient accumulation (low-precision parameters)


class ShardedOptimizer:
    """ZeRO stage 0/1/2 around a user's optimizer, over the data-parallel group.

    ``master_dtype`` (fp32 with ``bf16-true``/``16-true`` parameters): the optimizer steps master weights of that
    dtype (sharded at stage 1/2, whole at stage 0) and every micro-batch's gradient is added into a flat fp32 buffer
    (``p.main_grad``, as in Megatron) right after autograd produces it, so accumulation is in fp32 too.

    ``bucket_cap_mb``: with more than one replica, at stage 0 without master weights, reduce the gradients in
    :class:`GradientBuckets` of that size, overlapped with the step's last backward pass (``buckets``; the caller
    arms them before that pass); at stage 2, reduce every backward pass's gradients into this rank's shard in
    :class:`ShardedGradientBuckets` (so the full gradient never exists; ``tensor_sync`` is then applied per bucket,
    and ``parameter_order``, the model's parameters in registration order, gives the buckets backward's order).
    ``None`` (and stage 1): one flat reduction after the last backward pass.

    Example:
        >>> # strategy code, after configure_optimizers:
        >>> # zero = ShardedOptimizer(optimizer, stage=1, dp_mesh=mesh["data"])
        >>> # closure(); zero.reduce_gradients(); optimizer.step(); zero.gather_parameters()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        stage: int,
        dp_mesh: DeviceMesh,
        master_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: Optional[float] = None,
        tensor_sync: Optional[GradientSync] = None,
        parameter_order: Optional[list[nn.Parameter]] = None,
        host_masters: bool = False,
    ) -> None:
        assert stage in (0, 1, 2)
        self.optimizer = optimizer
        # optimizer offload (sharding/offload.py): the masters live in host memory (pinned on CUDA), where
        # DeepSpeedCPUAdam steps them; on a CPU-only machine they are where they would be anyway
        self.host_masters = host_masters
        self.group = dp_mesh.get_group()
        self.dp = dp_mesh.size()
        # one replica has nothing to shard: stages 1 and 2 would only add an fp32 copy of every parameter (the
        # masters) beside the parameters themselves; it steps as stage 0 (masters only for '-true' precisions)
        stage = stage if self.dp > 1 else 0
        self.stage = stage
        self.dp_rank = dp_mesh.get_local_rank()
        self.sharded = stage >= 1
        self.uses_masters = self.sharded or master_dtype is not None
        self.groups: list[_FlatGroup] = []
        self._flat_grads: list[Optional[Tensor]] = []
        for param_group in optimizer.param_groups:
            params = [p for p in param_group["params"] if p.requires_grad]
            numel = sum(local_tensor(p).numel() for p in params)
            shard = -(-numel // self.dp) if self.sharded else numel
            master = None
            if self.uses_masters and params:
                start = self.dp_rank * shard if self.sharded else 0
                master = nn.Parameter(self._master_shard(params, start, shard, master_dtype))
                param_group["params"] = [master]
            self.groups.append(_FlatGroup(params, numel, shard, master))
        if self.uses_masters:
            optimizer.state.clear()  # state of full parameters (if any) no longer matches the shards
            self._clear_model_gradients_on_zero_grad(optimizer)
        # ZeRO-2 reduces in buckets during every backward pass (ShardedGradientBuckets), in the shard's dtype
        zero2_buckets = bucket_cap_mb is not None and stage == 2 and self.dp > 1 and bool(self.model_parameters)
        # otherwise low-precision gradients are added into a full-size fp32 buffer as they come (p.main_grad)
        self.accumulates_in_fp32 = master_dtype is not None and not zero2_buckets
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        if self.accumulates_in_fp32:
            for p in self.model_parameters:
                p.register_post_accumulate_grad_hook(self._fold)
        self.buckets: Optional[GradientBuckets | ShardedGradientBuckets] = None
        if zero2_buckets:
            self.buckets = ShardedGradientBuckets(
                self.groups,
                group=self.group,
                dp=self.dp,
                dp_rank=self.dp_rank,
                bucket_cap_mb=bucket_cap_mb,
                dtype=next(g.master.dtype for g in self.groups if g.master is not None),
                tensor_sync=tensor_sync,
                parameter_order=parameter_order,
                host_copies=host_masters,
            )
        elif bucket_cap_mb is not None and not self.uses_masters and self.dp > 1 and self.model_parameters:
            self.buckets = GradientBuckets(
                list({id(p): p for p in self.model_parameters}.values()),
                group=self.group,
                dp=self.dp,
                bucket_cap_mb=bucket_cap_mb,
            )

    def _clear_model_gradients_on_zero_grad(self, optimizer: Optimizer) -> None:
        """The optimizer's groups hold the masters, but backward accumulates into the model's parameters: its
        ``zero_grad`` clears their gradients too, as the unwrapped optimizer's would. Otherwise a manual step with
        two optimizers added its second backward to the gradients its first left on the second optimizer's
        parameters (reduction only takes the gradients of the optimizer that steps). The fp32 accumulation buffers of
        low-precision parameters are left alone: under a pipeline, Lightning's ``zero_grad`` comes after the step's
        backward, which has already folded the gradients into them (a manual step with two optimizers in
        ``bf16-true`` is untested)."""
        clear_masters = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            clear_masters(set_to_none=set_to_none)
            for p in self.model_parameters:
                p.grad = None

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    @property
    def reduces_in_backward(self) -> bool:
        """Whether backward itself reduces the gradients into this rank's shard (ZeRO-2 buckets): afterwards no
        parameter holds a gradient, and the tensor-parallel sync has been applied bucket by bucket."""
        return isinstance(self.buckets, ShardedGradientBuckets)

    def _master_shard(
        self, params: list[Tensor], start: int, shard: int, master_dtype: Optional[torch.dtype]
    ) -> Tensor:
        """Elements ``[start, start + shard)`` of the parameters laid end to end (zeros past their end), copied
        piece by piece into the master buffer: concatenating them first would hold the group twice more at set-up
        (a 0.55B model's rank went 1.1 GB above its shards and masters)."""
        first = local_tensor(params[0])
        dtype = master_dtype or first.dtype
        on_host = self.host_masters and first.device.type != "cpu"
        buffer = torch.zeros(shard, dtype=dtype, device="cpu" if on_host else first.device, pin_memory=on_host)
        offset = 0
        with torch.no_grad():
            for p in params:
                local = local_tensor(p).detach().reshape(-1)
                low, high = max(start, offset), min(start + shard, offset + local.numel())
                if low < high:
                    buffer[low - start : high - start].copy_(local[low - offset : high - offset])
                offset += local.numel()
        return buffer

    def _to_master(self, grad: Tensor) -> Tensor:
        """A reduced gradient shard where the masters are. Under offload on CUDA: copied into pinned host memory
        without blocking (the offload waits for the copies once, before it steps), so the next group's reduction
        runs meanwhile; a shard the ZeRO-2 buckets already copied during backward arrives here in host memory."""
        if not self.host_masters or grad.device.type == "cpu":
            return grad
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        host.copy_(grad, non_blocking=True)
        return host

    def _padded(self, shard: int) -> int:
        return shard * self.dp if self.sharded else shard

    @property
    def model_parameters(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    # ------------------------------------------------------------------ fp32 gradient accumulation
    def _ensure_buffer(self, g: _FlatGroup) -> None:
        if g.grad_buffer is not None:
            return
        assert g.master is not None
        g.grad_buffer = torch.zeros(self._padded(g.shard_size), dtype=g.master.dtype, device=g.master.device)
        offset = 0
        for p in g.params:
            local = local_tensor(p)
            p.main_grad = g.grad_buffer[offset : offset + local.numel()].view(local.shape)
            offset += local.numel()

    @torch.no_grad()
    def _fold(self, p: nn.Parameter) -> None:
        """Add ``p``'s low-precision gradient into its fp32 ``main_grad`` and free it (autograd hook)."""
        g = _autograd_local_grad(p)
        if g is None:
            return
        self._ensure_buffer(self._group_of[id(p)])
        p.main_grad.add_(g)
        p.grad = None

    def fold_gradients(self) -> None:
        """Fold gradients left on parameters by paths that skip autograd's hooks (e.g. a pipeline schedule's
        separate weight-gradient pass). Call before any gradient reduction."""
        if self.accumulates_in_fp32:
            for p in self.model_parameters:
                self._fold(p)

    def _release_buffers(self, *, free: bool) -> None:
        for g in self.groups:
            if g.grad_buffer is None:
                continue
            if free:  # stage 2 keeps only the reduce-scattered shard between steps
                g.grad_buffer = None
                for p in g.params:
                    p.main_grad = None
            else:
                g.grad_buffer.zero_()

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def take_parameter_writes(self) -> None:
        """Weights written since the last step (a user's EMA or weight-averaging callback, a hook) reach the masters
        the optimizer steps; otherwise the step's gather overwrote them with the old values. Masters of the
        parameters' own dtype take this rank's shard of the parameters (an exact copy: unwritten, they are equal).
        Not done for fp32 masters of lower-precision parameters ('-true' precisions: the masters hold what the
        parameters' rounding lost) nor for host masters (offload: the copy would cross to the host every step)."""
        for g in self.groups:
            if g.master is None or g.master.device != local_tensor(g.params[0]).device:
                continue
            if any(local_tensor(p).dtype != g.master.dtype for p in g.params):
                continue
            start = self.dp_rank * g.shard_size if self.sharded else 0
            g.master.copy_(self._master_shard(g.params, start, g.shard_size, None))

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average gradients over the data-parallel group, once per optimizer step."""
        self.take_parameter_writes()
        self.fold_gradients()
        self._flat_grads = []
        if isinstance(self.buckets, ShardedGradientBuckets):
            # backward has reduced every pass into this rank's shard: average it
            for i, g in enumerate(self.groups):
                if g.master is not None:
                    # averaged before the copy to host memory, unless the buckets copied during backward (then after)
                    taken = self.buckets.take(i)
                    g.master.grad = (
                        self._to_master(taken.div_(self.dp)) if taken.device.type != "cpu" else taken.div_(self.dp)
                    )
                self._flat_grads.append(None)
            return
        if self.buckets is not None:
            self.buckets.reduce()  # usually done already, at the end of the armed backward pass
            return
        if not self.uses_masters and self.dp == 1:
            # nothing to reduce, and the optimizer steps the parameters' own gradients; one that DTensor autograd
            # left in another placement (a vocab-parallel embedding's comes back Replicate: the whole table on every
            # tensor-parallel rank) is cut to its parameter's placement, a local slice
            for g in self.groups:
                for p in g.params:
                    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            return
        for g in self.groups:
            if not g.params:
                self._flat_grads.append(None)
                continue
            if g.grad_buffer is not None:
                flat = g.grad_buffer
            else:
                flat = _flat_grads(g.params, pad_to=self._padded(g.shard_size))
                if g.master is not None:
                    flat = flat.to(g.master.dtype)
            if self.sharded:
                shard = flat.new_empty(g.shard_size)
                _reduce_scatter(shard, flat, group=self.group)
                shard.div_(self.dp)
                g.master.grad = self._to_master(shard)
                for p in g.params:
                    p.grad = None
                # stage 1 keeps the (unreduced) full-size buffer until the step, as ZeRO-1 accounts it
                self._flat_grads.append(flat if self.stage == 1 else None)
                continue
            if self.dp > 1:
                _all_reduce_mean(flat, self.group, self.dp)
            if g.master is None:
                for p in g.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                _unflatten_into([local_grad(p) for p in g.params], flat[: g.numel])
            else:
                start = self.dp_rank * g.shard_size if self.sharded else 0
                g.master.grad = self._to_master(flat[start : start + g.shard_size])
                for p in g.params:
                    p.grad = None
            self._flat_grads.append(flat)
        if self.stage == 2:
            self._release_buffers(free=True)

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """After the step: all-gather every rank's updated shard into the model's parameters; drop gradients."""
        if not self.uses_masters:
            return
        for g in self.groups:
            if g.master is None:
                continue
            # cast first: low-precision parameters need only low-precision bytes on the wire
            updated = g.master.detach().to(g.params[0].dtype)
            if updated.device != local_tensor(g.params[0]).device:  # host masters (offload): back to the device
                updated = updated.to(local_tensor(g.params[0]).device, non_blocking=True)
            full = updated
            if self.sharded:
                full = updated.new_empty(g.shard_size * self.dp)
                _all_gather(full, updated, group=self.group)
            _unflatten_into([local_tensor(p) for p in g.params], full[: g.numel])
            g.master.grad = None
        self._release_buffers(free=False)
        self._flat_grads = []

    @torch.no_grad()
    def discard_gradients(self) -> None:
        """A skipped step (gradient overflow): drop every gradient, leave parameters and optimizer state as they are."""
        for g in self.groups:
            if g.master is not None:
                g.master.grad = None
            for p in g.params:
                p.grad = None
        self._release_buffers(free=self.stage == 2)
        self._flat_grads = []
        if self.buckets is not None:
            self.buckets.reset()

    def gathered_gradients(self) -> list[Optional[Tensor]]:
        """Each parameter's data-parallel-reduced local gradient, in ``model_parameters`` order (for inspection)."""
        out: list[Optional[Tensor]] = []
        for g, flat in zip(self.groups, self._flat_grads or [None] * len(self.groups)):
            if g.master is None:
                out.extend(local_grad(p) for p in g.params)
                continue
            if self.sharded and g.master.grad is not None:  # only this rank's shard is reduced: gather them
                flat = g.master.grad.new_empty(g.shard_size * self.dp)
                _all_gather(flat, g.master.grad, group=self.group)
            offset = 0
            for p in g.params:
                n = local_tensor(p).numel()
                out.append(None if flat is None else flat[offset : offset + n].view_as(local_tensor(p)))
                offset += n
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer-owned tensors on this rank (state and the master copy, if any)."""
        tensors = [local_tensor(t) for s in self.optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
        return total + sum(g.master.numel() * g.master.element_size() for g in self.groups if g.master is not None)

    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds at the step (full, reduced-shard or fp32 accumulation buffer)."""
        if isinstance(self.buckets, GradientBuckets):
            # kept between steps, as DDP's buckets; the gradients are views of them (the few used-flag elements after
            # them are bookkeeping, not gradients)
            return sum(sum(v.numel() for v in b.views) * b.buffer.element_size() for b in self.buckets.buckets)
        total = 0
        for g, flat in zip(self.groups, self._flat_grads or [None] * len(self.groups)):
            if g.grad_buffer is not None:
                total += local_bytes(g.grad_buffer)  # the master's gradient is a view of it
            elif self.stage == 2 or (g.master is not None and flat is None):
                total += local_bytes(g.master.grad) if g.master is not None and g.master.grad is not None else 0
            elif g.master is not None:
                total += local_bytes(flat)
            else:
                total += sum(local_bytes(p.grad) for p in g.params if p.grad is not None)
        return total


def _strided(p: nn.Parameter) -> bool:
    return isinstance(p, DTensor) and any(is_strided_shard(pl) for pl in p.placements)


def apply_fully_shard(
    module: nn.Module, block_names: list[str], roots: Optional[list[str]], dp_mesh: DeviceMesh, **kwargs: Any
) -> list[str]:
    """ZeRO-3: FSDP2 ``fully_shard`` each transformer block, then each root (the rest of the parameters), innermost
    first (``ModelStructure.fully_shard_roots``). ``roots=None``: the caller wraps what the blocks leave itself (each
    pipeline stage module).

    Parameters are gathered before each block's forward/backward and freed after (``reshard_after_forward``).
    Returns the names of parameters left out of FSDP2 (fused tensor-parallel biases and, given ``roots``, those
    outside every block and root), which stay replicated: the caller must average their gradients over ``dp_mesh``.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if user_fully_sharded(module):
        # the LightningModule's configure_model applied fully_shard itself (as written for Lightning's
        # ModelParallelStrategy): a second one would fail or shard twice; what its units leave out stays replicated
        return [n for n, p in module.named_parameters() if not _sharded_over(p, dp_mesh)]

    # A fused projection split by tensor parallel (_StridedShard on its fused dim) composes wrongly with FSDP2's own
    # split of that same dim (full_tensor() and checkpoints would see permuted rows): shard such weights on their
    # first other dim instead (dim 1 of a fused q|k|v weight, the expert dim of packed MoE experts), and leave 1-D ones
    # (fused biases, tiny) replicated over the data dimension.
    ignored = {p for p in module.parameters() if _strided(p) and p.dim() < 2}

    def placement(p: nn.Parameter) -> Optional[Shard]:
        if not _strided(p):
            return None
        fused = {pl.dim % p.dim() for pl in p.placements if is_strided_shard(pl)}
        return Shard(next(d for d in range(p.dim()) if d not in fused))

    covered: set[nn.Parameter] = set()
    for name in [*block_names, *(roots or [])]:
        target = module.get_submodule(name) if name else module
        fully_shard(target, mesh=dp_mesh, shard_placement_fn=placement, ignored_params=ignored, **kwargs)
        covered.update(target.parameters())
    left_out = ignored if roots is None else ignored | (set(module.parameters()) - covered)
    return [n for n, p in module.named_parameters() if p in left_out]


def user_fully_sharded(module: nn.Module) -> bool:
    """Whether ``module`` already holds FSDP2 units (``fully_shard`` applied in the user's ``configure_model``).

    Example:
        >>> user_fully_sharded(nn.Linear(2, 2))
        False
    """
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _sharded_over(p: nn.Parameter, dp_mesh: DeviceMesh) -> bool:
    """A parameter an FSDP2 unit shards over the data-parallel dimension: a DTensor on a mesh with that dimension."""
    from torch.distributed.tensor import DTensor

    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    return any(name in names for name in dp_mesh.mesh_dim_names or ())


def check_user_sharding(module: nn.Module, zero_stage: int, pipeline_parallel_size: int = 1) -> None:
    """Refuse a ``zero_stage`` below 3 for a module whose ``configure_model`` applied ``fully_shard`` (that is
    ZeRO-3 already; a ZeRO-1/2 optimizer over FSDP2's shards would shard them again). Collective-free.

    Example:
        >>> check_user_sharding(nn.Linear(2, 2), zero_stage=1)
    """
    if pipeline_parallel_size > 1 and user_fully_sharded(module):
        from lightning_hybrid.config import HybridConfigError

        # each pipeline stage is its own FSDP2 unit; the user's units span the whole model (a second fully_shard
        # over their DTensors fails: "Cannot concatenate overlapping meshes")
        raise HybridConfigError(
            f"`pipeline_parallel_size={pipeline_parallel_size}`, but the LightningModule's `configure_model` already"
            " applied FSDP2's `fully_shard` to the whole model; under pipeline parallel each stage is sharded on its"
            " own. Remove `fully_shard` from `configure_model` and pass `zero_stage=3` (HybridStrategy shards each"
            " stage), or use `pipeline_parallel_size=1`."
        )
    if zero_stage < 3 and user_fully_sharded(module):
        from lightning_hybrid.config import HybridConfigError

        raise HybridConfigError(
            f"`zero_stage={zero_stage}`, but the LightningModule's `configure_model` already applied FSDP2's"
            " `fully_shard` (parameters sharded over the data-parallel dimension: ZeRO-3). Pass `zero_stage=3`, or"
            " leave the sharding to HybridStrategy and remove `fully_shard` from `configure_model`."
        )
