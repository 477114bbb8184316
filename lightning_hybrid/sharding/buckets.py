"""DDP-style gradient buckets (ZeRO-0): the data-parallel average of the gradients in flat buckets, each started
asynchronously once its parameters' gradients are in, overlapped with the rest of the backward pass.

:class:`InOrderLaunch` is what these buckets share with the ZeRO-2 buckets (``sharded_buckets.py``): buckets start
strictly in order on every rank, so the collectives match, and whatever is left starts when backward ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid._torch_compat import queue_autograd_callback
from lightning_hybrid.dtensor import autograd_local_grad, like, local_tensor

__all__ = ["GradientBuckets", "InOrderLaunch"]


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


class InOrderLaunch:
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


class GradientBuckets(InOrderLaunch):
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
        g = autograd_local_grad(p)
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
