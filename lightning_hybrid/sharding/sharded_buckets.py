"""ZeRO-2 gradient buckets: every backward pass's gradients reduced, bucket by bucket as backward produces them, to
the data-parallel ranks whose shards hold them, so that no rank ever holds the full gradient."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.dtensor import autograd_local_grad, local_tensor
from lightning_hybrid.sharding.buckets import InOrderLaunch
from lightning_hybrid.sharding.flat import FlatGroup
from lightning_hybrid.sharding.gradient_sync import GradientSync

__all__ = ["ShardedGradientBuckets"]


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
    flat offset, so the bucket is one reduce-scatter whatever groups its parameters come from (each owner receives its
    piece, of its own length; a rank that owns none receives nothing), and each owner adds a few contiguous runs into
    its shard. (Cutting buckets at every change of optimizer group instead gave the example's decay / no-decay groups
    35 buckets of one to three parameters: 35 collectives per backward pass.)"""

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
        self.owners: list[tuple[int, int, int]] = []  # (owner, lo, hi) in the buffer: the owners' pieces
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
        self.received: Optional[Tensor] = None  # this rank's piece of the buffer, reduced in place
        self.reported: set[int] = set()
        self.handles: list[Any] = []
        self.launches = 0
        self.launched_in_backward = 0

    def views(self, buffer: Tensor) -> tuple[list[nn.Parameter], list[Tensor]]:
        """Each parameter's gradient in ``buffer`` as its pieces, parameter by parameter and in element order (a
        parameter across a shard boundary is listed once per piece): what the tensor-parallel sync reads."""
        return [p for p, _, _ in self._sync_order], [buffer[at : at + n] for _, at, n in self._sync_order]


class ShardedGradientBuckets(InOrderLaunch):
    """ZeRO-2 gradient reduction in buckets during every backward pass, so that no rank holds more than its gradient
    shard plus the buckets in flight (DeepSpeed's stage 2 design, with DDP's bucket order):

    * the parameters, in the order backward produces their gradients (the model's, reversed), are cut into buckets
      of whole parameters of about ``bucket_cap_mb`` (the first at most 1 MiB), across optimizer groups; each
      group's flat buffer keeps the ZeRO-1/2 layout (rank ``d`` owns its contiguous slice ``d``), and a bucket's
      buffer is its parameters' pieces ordered by the rank that owns them;
    * a post-accumulate-grad hook adds a parameter's gradient into its bucket (in the shard's dtype: fp32 under
      '-true' precisions) and frees autograd's tensor (``p.grad = None``);
    * once every parameter of the next bucket has reported, its pieces are reduced, asynchronously, to the ranks
      whose shards hold them: one reduce-scatter per bucket, each rank receiving its own piece (of its own length,
      often nothing: ``dist.reduce_scatter`` of a list, which gloo and NCCL take uneven). Buckets start in
      order on every rank; at most ``MAX_IN_FLIGHT`` are in flight: starting one more first waits for the oldest,
      which its owner adds into its shard accumulator and every rank frees. The rest start when backward ends. So
      a rank holds its shard plus at most ``MAX_IN_FLIGHT + 1`` bucket buffers (those in flight and the one
      filling) and autograd's gradient of the parameter being added;
    * every backward pass reduces, gradient-accumulation passes included, and adds into the shard accumulator (as
      DeepSpeed's stage 2 does): keeping the full gradient between micro-batches would be ZeRO-1's memory.
      :meth:`take` hands the accumulated shard to the optimizer at the step.

    The uneven reduce-scatter keeps the shard layout of stage 1 (and of checkpoints); an even one per bucket would
    give each rank a slice of every bucket instead (Megatron's layout). It replaced one ``dist.reduce`` per owner (up
    to dp collectives per bucket).

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
        groups: list[FlatGroup],
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
        # per bucket, each data-parallel rank's piece of the buffer (empty for a rank that owns none of it)
        self._pieces: list[list[tuple[int, int]]] = []
        for b in self.buckets:
            pieces = [(0, 0)] * dp
            for q, lo, hi in b.owners:
                pieces[q] = (lo, hi)
            self._pieces.append(pieces)
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
        g = autograd_local_grad(p)
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
        pieces = self._pieces[b.index]
        lo, hi = pieces[self.dp_rank]
        # in place: this rank's reduced piece lands where its own contribution was (gloo and NCCL allow it)
        b.received = buffer[lo:hi]
        inputs = [buffer[a:z] for a, z in pieces]
        b.handles.append(dist.reduce_scatter(b.received, inputs, group=self.group, async_op=True))
        b.launches += 1
        b.launched_in_backward += int(in_backward)
        self._next += 1
        self._in_flight.append(b)

    def _settle(self, b: _ShardBucket) -> None:
        """Wait for the bucket's reduce-scatter; the owner adds its piece into its shard; the buffers are freed."""
        for handle in b.handles:
            handle.wait()
        b.handles = []
        first = self._pieces[b.index][self.dp_rank][0]  # where this rank's piece starts in the bucket's buffer
        for q, g, lo, hi, at in b.runs:
            if q == self.dp_rank and b.received is not None:
                shard = self.flat_groups[g].shard_size
                base = self.dp_rank * shard
                acc = self._accumulators[g]
                if acc is None:
                    acc = self._accumulators[g] = torch.zeros(shard, dtype=self.dtype, device=self.device)
                acc[lo - base : hi - base].add_(b.received[at - first : at - first + hi - lo])
                if self._host is not None and self._armed:  # final for this step: to host memory, not waited for
                    self._host[g][lo - base : hi - base].copy_(acc[lo - base : hi - base], non_blocking=True)
                    self._copied[g] += hi - lo
        b.buffer = b.received = None
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
            b.handles, b.buffer, b.received = [], None, None
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
