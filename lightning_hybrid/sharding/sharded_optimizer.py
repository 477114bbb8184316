"""The ZeRO-0/1/2 optimizer over the data-parallel dimension (stage 3 is FSDP2: ``fsdp.py``).

Stages 0-2 keep whole parameters on every replica, which FSDP2 cannot express and ``ZeroRedundancyOptimizer`` cannot
do for DTensor parameters or evenly (it shards whole tensors), so they are written here, in the flat-buffer form
DeepSpeed and Megatron's distributed optimizer use (``flat.py``):

* gradients are reduced once per optimizer step, after all micro-batches (stage 0: all-reduce; stage 1/2:
  reduce-scatter into the rank's shard, so with the all-gather after the step a ZeRO step moves what one DDP
  all-reduce moves; stage 1 keeps the full-size gradient buffer until the step, stage 2 frees it at once);
* stage 0 without master weights (and without a pipeline, whose schedule runs its own backward passes) can instead
  reduce in gradient buckets during the step's last backward pass, overlapping communication with the rest of the
  backward pass as DDP does (:class:`~lightning_hybrid.sharding.buckets.GradientBuckets`); stage 2 can reduce every
  backward pass into the shards (:class:`~lightning_hybrid.sharding.sharded_buckets.ShardedGradientBuckets`);
* stage 1/2: each rank owns ``1/dp`` of a flat copy of every parameter group, the user's optimizer object is kept
  (so LR schedulers and hyper-parameters keep working) but steps only that shard; the updated shards are all-gathered
  back into the model's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_hybrid._torch_compat import tensor_version
from lightning_hybrid.dtensor import autograd_local_grad, local_bytes, local_grad, local_tensor
from lightning_hybrid.sharding.buckets import GradientBuckets
from lightning_hybrid.sharding.flat import (
    DataDomain,
    FlatGroup,
    all_gather_flat,
    all_reduce_mean,
    flat_grads,
    reduce_scatter_flat,
    unflatten_into,
)
from lightning_hybrid.sharding.gradient_sync import GradientSync
from lightning_hybrid.sharding.sharded_buckets import ShardedGradientBuckets

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedOptimizer"]


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

    ``expert_parameters`` (ids) and ``expert_domain``: under expert parallel, the expert weights form flat groups of
    their own, reduced and sharded over the ranks holding the same experts (:class:`DataDomain`), not all of
    ``dp_mesh``.

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
        expert_parameters: frozenset[int] = frozenset(),
        expert_domain: Optional[DataDomain] = None,
    ) -> None:
        assert stage in (0, 1, 2)
        self.optimizer = optimizer
        # optimizer offload (sharding/offload.py): the masters live in host memory (pinned on CUDA), where
        # DeepSpeedCPUAdam steps them; on a CPU-only machine they are where they would be anyway
        self.host_masters = host_masters
        self.group = dp_mesh.get_group()
        self.dp = dp_mesh.size()
        self.dp_rank = dp_mesh.get_local_rank()
        self.domain = DataDomain(self.group, self.dp, self.dp_rank)
        # one replica has nothing to shard: stages 1 and 2 would only add an fp32 copy of every parameter (the
        # masters) beside the parameters themselves; it steps as stage 0 (masters only for '-true' precisions)
        stage = stage if self.dp > 1 else 0
        self.stage = stage
        self.sharded = stage >= 1
        self.uses_masters = self.sharded or master_dtype is not None
        self.groups: list[FlatGroup] = []
        self._flat_grads: list[Optional[Tensor]] = []
        for param_group in optimizer.param_groups:
            trained = [p for p in param_group["params"] if p.requires_grad]
            # expert weights (expert parallel) are reduced and sharded over the ranks holding the same experts: a
            # flat group of their own in the same optimizer group, so they step with its hyper-parameters
            split = [([p for p in trained if id(p) not in expert_parameters], self.domain)]
            experts = [p for p in trained if id(p) in expert_parameters]
            if experts:
                assert expert_domain is not None
                split.append((experts, expert_domain))
            masters = []
            for params, domain in split:
                numel = sum(local_tensor(p).numel() for p in params)
                shard = domain.sharded_size(numel) if self.sharded else numel
                master = None
                if self.uses_masters and params:
                    start = domain.rank * shard if self.sharded else 0
                    master = nn.Parameter(self._master_shard(params, start, shard, master_dtype))
                    masters.append(master)
                self.groups.append(FlatGroup(params, numel, shard, master, domain=domain))
            if masters:
                param_group["params"] = masters
        # the parameters' version counters when the masters last matched them (take_parameter_writes)
        self._gathered_versions = [_versions(g.params) for g in self.groups]
        if self.uses_masters:
            optimizer.state.clear()  # state of full parameters (if any) no longer matches the shards
        # ZeRO-2 reduces in buckets during every backward pass (ShardedGradientBuckets), in the shard's dtype
        # (not with expert weights: their groups reduce over other ranks, after the last backward pass)
        bucketed = bucket_cap_mb is not None and self.dp > 1 and bool(self.model_parameters)
        bucketed = bucketed and all(g.domain is self.domain for g in self.groups)
        zero2_buckets = bucketed and stage == 2
        # otherwise low-precision gradients are added into a full-size fp32 buffer as they come (p.main_grad)
        self.accumulates_in_fp32 = master_dtype is not None and not zero2_buckets
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        self._fold_hooks = (
            [p.register_post_accumulate_grad_hook(self._fold) for p in self.model_parameters]
            if self.accumulates_in_fp32 else []
        )  # fmt: skip
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
        elif bucketed and not self.uses_masters:
            self.buckets = GradientBuckets(
                list({id(p): p for p in self.model_parameters}.values()),
                group=self.group,
                dp=self.dp,
                bucket_cap_mb=bucket_cap_mb,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The user's optimizer's ``zero_grad`` (its groups hold the masters), and the model's gradients too, as the
        unwrapped optimizer's would clear them: otherwise a manual step with two optimizers added its second backward
        to the gradients its first left on the second optimizer's parameters (reduction only takes the gradients of
        the optimizer that steps). Lightning's wrapper of this optimizer calls it (``ZeroLightningOptimizer`` in
        ``sharding/gradient_step.py``); the user's optimizer object and its class are left as they are. The fp32
        accumulation buffers of low-precision parameters are left alone: under a pipeline, Lightning's ``zero_grad``
        comes after the step's backward, which has already folded the gradients into them (a manual step with two
        optimizers in ``bf16-true`` is untested)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.uses_masters:
            for p in self.model_parameters:
                p.grad = None

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

    def _padded(self, g: FlatGroup) -> int:
        return g.shard_size * g.ranks.size if self.sharded else g.shard_size

    @property
    def model_parameters(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    # ------------------------------------------------------------------ fp32 gradient accumulation
    def _ensure_buffer(self, g: FlatGroup) -> None:
        if g.grad_buffer is not None:
            return
        assert g.master is not None
        g.grad_buffer = torch.zeros(self._padded(g), dtype=g.master.dtype, device=g.master.device)
        offset = 0
        for p in g.params:
            local = local_tensor(p)
            p.main_grad = g.grad_buffer[offset : offset + local.numel()].view(local.shape)
            offset += local.numel()

    def remove_hooks(self) -> None:
        """Stop listening to backward (the fit ended, or a new one replaces this optimizer). A parameter's gradient
        hook is held from C++, out of the garbage collector's reach: left in place, it would keep this optimizer, its
        buffers and its process groups alive after the model is dropped."""
        for handle in self._fold_hooks:
            handle.remove()
        self._fold_hooks = []
        if self.buckets is not None:
            self.buckets.remove_hooks()

    @torch.no_grad()
    def _fold(self, p: nn.Parameter) -> None:
        """Add ``p``'s low-precision gradient into its fp32 ``main_grad`` and free it (autograd hook)."""
        g = autograd_local_grad(p)
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
        the optimizer steps; otherwise the step's gather overwrote them with the old values. Only groups whose
        parameters were written since the gather (autograd's version counter moved) are copied: this rank's shard of
        the parameters, exact (unwritten, they are equal), into a master of the parameters' own dtype. Not done for
        fp32 masters of lower-precision parameters ('-true' precisions: the masters hold what the parameters'
        rounding lost) nor for host masters (offload: the copy would cross to the host every step)."""
        for g, seen in zip(self.groups, self._gathered_versions):
            if g.master is None or g.master.device != local_tensor(g.params[0]).device:
                continue
            if seen == _versions(g.params) or any(local_tensor(p).dtype != g.master.dtype for p in g.params):
                continue
            start = g.ranks.rank * g.shard_size if self.sharded else 0
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
                flat = flat_grads(g.params, pad_to=self._padded(g))
                if g.master is not None:
                    flat = flat.to(g.master.dtype)
            if self.sharded:
                shard = flat.new_empty(g.shard_size)
                reduce_scatter_flat(shard, flat, group=g.ranks.group)
                shard.div_(g.ranks.size)
                g.master.grad = self._to_master(shard)
                for p in g.params:
                    p.grad = None
                # stage 1 keeps the (unreduced) full-size buffer until the step, as ZeRO-1 accounts it
                self._flat_grads.append(flat if self.stage == 1 else None)
                continue
            if g.ranks.size > 1:
                all_reduce_mean(flat, g.ranks.group, g.ranks.size)
            if g.master is None:
                for p in g.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                unflatten_into([local_grad(p) for p in g.params], flat[: g.numel])
            else:
                start = g.ranks.rank * g.shard_size if self.sharded else 0
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
                full = updated.new_empty(g.shard_size * g.ranks.size)
                all_gather_flat(full, updated, group=g.ranks.group)
            unflatten_into([local_tensor(p) for p in g.params], full[: g.numel])
            g.master.grad = None
        self._gathered_versions = [_versions(g.params) for g in self.groups]  # what take_parameter_writes compares
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
                flat = g.master.grad.new_empty(g.shard_size * g.ranks.size)
                all_gather_flat(flat, g.master.grad, group=g.ranks.group)
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


def _versions(params: list[nn.Parameter]) -> tuple[int, ...]:
    """The version counters of ``params``' local tensors: they move on every in-place write (ours and a user's)."""
    return tuple(tensor_version(local_tensor(p)) for p in params)
