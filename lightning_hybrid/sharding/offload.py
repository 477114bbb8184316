"""Optimizer offload (ZeRO-Offload): the fp32 master weights and Adam's moments of this rank live in host memory and
are stepped there by DeepSpeed's vectorized ``DeepSpeedCPUAdam``.

The device keeps the parameters and the gradient buckets only. Per optimizer step:

1. the gradients this rank steps on (its ZeRO-1/2 flat shard, or at ZeRO-0/3 each parameter's local gradient) are
   copied to host memory. On CUDA the copies go to pinned buffers without blocking: at ZeRO-2 with bucketed reduction
   (the default) each bucket's piece of the shard is copied as soon as the last backward pass has reduced it, so the
   copies overlap the rest of the backward pass; at ZeRO-1 each group's copy follows its reduce-scatter;
2. once they have arrived, ``DeepSpeedCPUAdam`` steps the host masters with the hyper-parameters of the user's
   optimizer's parameter groups, read at every step (so LR schedulers keep working);
3. the updated masters go back to the device: at ZeRO-1/2 as the all-gather input (``ShardedOptimizer``), at ZeRO-0/3
   copied into each parameter's local tensor.

On a CPU-only machine the same path runs, with the "host" copies being the tensors themselves (nothing is copied):
``DeepSpeedCPUAdam`` replaces torch's Adam/AdamW kernels.

The user's optimizer object stays in place: its ``param_groups`` hold the hyper-parameters and its ``state`` the
moments (in torch's layout, ``step`` a float tensor), so checkpoints, ``optimizer.param_groups[0]["lr"]`` and
schedulers see what they see without offload. Only its ``step`` is replaced.

DeepSpeed is an optional dependency (``pip install "lightning-hybrid[deepspeed]"``), imported only here.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid._torch_compat import (
    dtensor_local_data,
    extension_build_directory,
    mark_optimizer_stepped,
    mark_step_reports_itself,
    tensor_version,
)
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.dtensor import like

if TYPE_CHECKING:
    from lightning_hybrid.sharding.sharded_optimizer import ShardedOptimizer

__all__ = ["OptimizerOffload", "attach_offload", "check_offloadable", "cpu_adam_class", "offload_ledger"]

EXTRA = 'pip install "lightning-hybrid[deepspeed]"'
_STATS = ("exp_avg", "exp_avg_sq")


def cpu_adam_class() -> type:
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``, with its C++ op loaded (compiled on first use, with a message).

    Raises :class:`HybridConfigError` naming the extra when DeepSpeed is not installed.
    """
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as error:
        raise HybridConfigError(
            f"`offload_optimizer=True` steps the optimizer with DeepSpeed's DeepSpeedCPUAdam, but DeepSpeed cannot be"
            f" imported ({error}). Install the extra: {EXTRA}, or set `offload_optimizer=False`."
        ) from None
    builder = CPUAdamBuilder()
    if not _op_is_built(builder):
        from lightning_utilities.core.rank_zero import rank_zero_info

        rank_zero_info(
            "lightning-hybrid: compiling DeepSpeed's CPU Adam op for `offload_optimizer=True` (first use only, about a"
            " minute; cached in torch's extension directory afterwards)..."
        )
    builder.load(verbose=False)  # the ranks of a node share the build: torch's extension loader locks it
    return DeepSpeedCPUAdam


def _op_is_built(builder: Any) -> bool:
    """Whether the op is prebuilt into DeepSpeed or already compiled into torch's extension cache."""
    if importlib.util.find_spec(builder.absolute_name()) is not None:
        return True
    try:
        directory = extension_build_directory(builder.name)
    except Exception:
        return False
    return os.path.isfile(os.path.join(directory, f"{builder.name}.so"))


def check_offloadable(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is one ``DeepSpeedCPUAdam`` can step exactly; returns its ``adamw_mode``.

    Raises :class:`HybridConfigError` naming the option that has no DeepSpeedCPUAdam equivalent. Collective-free and
    the same on every rank (every rank builds the same optimizer).

    Example:
        >>> import torch
        >>> check_offloadable(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), weight_decay=0.1))
        True
    """
    cls = type(optimizer)
    name = cls.__name__
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        raise HybridConfigError(
            f"`offload_optimizer=True` steps the optimizer with DeepSpeed's DeepSpeedCPUAdam, which implements Adam"
            f" and AdamW only; `configure_optimizers` returned {name}. Return torch.optim.Adam or torch.optim.AdamW,"
            " or set `offload_optimizer=False`."
        )
    is_adamw = cls is torch.optim.AdamW
    # Adam(decoupled_weight_decay=True) is AdamW (torch >= 2.6); AdamW always decouples
    decoupled = {is_adamw or bool(g.get("decoupled_weight_decay", False)) for g in optimizer.param_groups}
    if len(decoupled) > 1:
        raise HybridConfigError(
            f"`offload_optimizer=True`: the parameter groups of {name} mix `decoupled_weight_decay` True and False;"
            " DeepSpeedCPUAdam takes one mode per optimizer. Use one mode, or two optimizers."
        )
    for index, group in enumerate(optimizer.param_groups):
        _check_group(name, index, group)
    return decoupled.pop()


def _check_group(name: str, index: int, group: dict[str, Any]) -> None:
    unsupported = {"amsgrad": True, "maximize": True, "differentiable": True}
    for key, bad in unsupported.items():
        if group.get(key) == bad:
            raise HybridConfigError(
                f"`offload_optimizer=True`: {name}({key}={bad}) (parameter group {index}) has no DeepSpeedCPUAdam"
                f" equivalent. Set {key}=False, or `offload_optimizer=False`."
            )
    for key in ("lr", "eps", "weight_decay"):
        if isinstance(group.get(key), Tensor):
            raise HybridConfigError(
                f"`offload_optimizer=True`: {name}'s `{key}` is a tensor (parameter group {index}); DeepSpeedCPUAdam"
                f" takes a float. Pass {key} as a float, or set `offload_optimizer=False`."
            )
    if any(isinstance(b, Tensor) for b in group.get("betas", ())):
        raise HybridConfigError(
            f"`offload_optimizer=True`: {name}'s `betas` are tensors (parameter group {index}); DeepSpeedCPUAdam takes"
            " floats. Pass floats, or set `offload_optimizer=False`."
        )


class _Slot:
    """One tensor the host optimizer steps: the host copy of the master (a view of it when it already lives in host
    memory) and, for parameters on an accelerator, pinned buffers for its gradient and the copy-back target."""

    def __init__(self, param: Tensor, pin: bool) -> None:
        local = dtensor_local_data(param).detach()
        self.param = param
        self.on_host = local.device.type == "cpu"
        if self.on_host:
            self.host = local  # shares storage: the step writes the parameter (or ZeRO master) in place
            self.grad_buffer: Optional[Tensor] = None
        else:
            self.host = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
            self.host.copy_(local)
            self.grad_buffer = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
        # the device tensor changed behind our back (a checkpoint load) if this moves
        self.version = tensor_version(local)

    def refresh(self) -> None:
        """Take the device tensor's value again if something else wrote it since the last step (a load)."""
        if self.on_host:
            return
        local = dtensor_local_data(self.param).detach()
        if tensor_version(local) != self.version:
            self.host.copy_(local)
            self.version = tensor_version(local)


class OptimizerOffload:
    """Steps ``optimizer`` (torch Adam/AdamW) with ``DeepSpeedCPUAdam`` on host-memory masters and moments.

    ``sharded``: the optimizer's :class:`~lightning_hybrid.sharding.ShardedOptimizer` (ZeRO-0/1/2), whose flat masters
    it then keeps in host memory; ``None`` at ZeRO-3 (the optimizer holds FSDP2's sharded parameters). The optimizer's
    ``step`` is replaced by :meth:`step`; everything else about the optimizer stays.

    Example:
        >>> # offload = OptimizerOffload(optimizer, sharded=zero)   # in the strategy's setup_optimizers
        >>> # optimizer.step()                                      # now a DeepSpeedCPUAdam step in host memory
    """

    def __init__(self, optimizer: Optimizer, sharded: Optional[ShardedOptimizer] = None) -> None:
        adamw_mode = check_offloadable(optimizer)
        cls = cpu_adam_class()
        self.optimizer = optimizer
        self.sharded = sharded
        self.pin = torch.cuda.is_available()
        defaults = optimizer.defaults
        # the hyper-parameters given here are only the op's initial ones: every step passes each group's own values
        self.cpu_adam = cls(
            [torch.zeros(1)],
            lr=float(defaults["lr"]),
            betas=tuple(float(b) for b in defaults["betas"]),
            eps=float(defaults["eps"]),
            weight_decay=float(defaults["weight_decay"]),
            adamw_mode=adamw_mode,
        )
        self._slots: dict[int, _Slot] = {}
        self.steps = 0
        self.skipped = 0
        optimizer.step = _offloaded_step(optimizer, self)  # type: ignore[method-assign]

    def _slot(self, p: Tensor) -> _Slot:
        slot = self._slots.get(id(p))
        if slot is None or slot.param is not p:
            slot = self._slots[id(p)] = _Slot(p, self.pin)
        return slot

    def _state(self, p: Tensor, slot: _Slot) -> dict[str, Any]:
        """The user's optimizer's state of ``p`` in torch's layout, its moments in host memory (made on the first
        step; moved back to host memory after a checkpoint load put them on the parameter's device)."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
        for stat in _STATS:
            value = state.get(stat)
            if value is None:
                local = torch.zeros(slot.host.shape, dtype=torch.float32, pin_memory=self.pin and not slot.on_host)
            elif dtensor_local_data(value).device.type != "cpu" or dtensor_local_data(value).dtype != torch.float32:
                local = dtensor_local_data(value).detach().to("cpu", torch.float32)
                if self.pin:
                    local = local.pin_memory()
            else:
                continue
            state[stat] = like(local, p)
        if isinstance(state["step"], Tensor) and state["step"].device.type != "cpu":
            state["step"] = state["step"].detach().cpu()
        return state

    @torch.no_grad()
    def step(self) -> None:
        """One DeepSpeedCPUAdam step of every parameter with a gradient, in host memory; the device copies updated."""
        groups: list[dict[str, Any]] = []
        states: dict[Tensor, dict[str, Any]] = {}
        written: list[tuple[_Slot, dict[str, Any]]] = []
        copies = False
        for group in self.optimizer.param_groups:
            _check_group(type(self.optimizer).__name__, len(groups), group)
            hosts = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                slot = self._slot(p)
                slot.refresh()
                grad = dtensor_local_data(p.grad).detach()
                if grad.device.type == "cpu":
                    slot.host.grad = grad if grad.dtype == torch.float32 else grad.float()
                else:
                    assert slot.grad_buffer is not None
                    slot.grad_buffer.copy_(grad, non_blocking=True)  # pinned: queued, waited for once below
                    slot.host.grad = slot.grad_buffer
                    copies = True
                state = self._state(p, slot)
                states[slot.host] = {
                    "step": int(state["step"]),
                    **{stat: dtensor_local_data(state[stat]) for stat in _STATS},
                }
                written.append((slot, state))
                hosts.append(slot.host)
            groups.append(
                {
                    "params": hosts,
                    "lr": float(group["lr"]),
                    "betas": tuple(float(b) for b in group["betas"]),
                    "eps": float(group["eps"]),
                    "weight_decay": float(group["weight_decay"]),
                    "bias_correction": True,
                    "amsgrad": False,
                }
            )
        if copies:
            torch.cuda.current_stream().synchronize()  # the gradients' device-to-host copies have landed
        self._wait_for_sharded_copies()
        self.cpu_adam.param_groups = groups
        self.cpu_adam.state = states
        self.cpu_adam.step()
        for slot, state in written:
            step = states[slot.host]["step"]
            if isinstance(state["step"], Tensor):
                state["step"].fill_(float(step))
            else:
                state["step"] = torch.tensor(float(step))
            slot.host.grad = None
            if not slot.on_host:  # back to the device (ZeRO-0/3 parameters; ZeRO-1/2 masters live on the host)
                local = dtensor_local_data(slot.param).detach()
                local.copy_(slot.host, non_blocking=True)
                slot.version = tensor_version(local)
        self.cpu_adam.param_groups, self.cpu_adam.state = [], {}
        self.steps += 1

    def _wait_for_sharded_copies(self) -> None:
        if self.sharded is not None and self.pin:
            # ZeRO-1/2 copied each reduced shard to its host master's gradient without blocking
            torch.cuda.current_stream().synchronize()

    def host_bytes(self) -> int:
        """Bytes of the optimizer's masters and moments this offload keeps in host memory."""
        total = 0
        for s in self.optimizer.state.values():
            total += sum(dtensor_local_data(s[k]).numel() * 4 for k in _STATS if k in s)
        if self.sharded is not None:
            masters = [g.master for g in self.sharded.groups if g.master is not None]
            total += sum(m.numel() * m.element_size() for m in masters)
        else:
            total += sum(s.host.numel() * 4 for s in self._slots.values() if not s.on_host)
        return total


def _offloaded_step(optimizer: Optimizer, offload: OptimizerOffload) -> Any:
    """``optimizer.step`` under offload: the closure (if any), then the host step."""

    def step(closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mark_optimizer_stepped(optimizer)  # what torch's LR schedulers check for
        offload.step()
        return loss

    # torch's LR schedulers wrap `optimizer.step` to see that it ran; this one reports it itself (above)
    mark_step_reports_itself(step)
    return step


def offload_ledger(measured: dict[str, int], offloads: list[OptimizerOffload]) -> dict[str, int]:
    """The model-state report with the offloaded optimizer state moved out of the device's part: ``optimizer_state``
    is what stays on the device (nothing), ``offloaded_optimizer_state`` what host memory holds instead."""
    if not offloads:
        return measured
    host = sum(o.host_bytes() for o in offloads)
    out = dict(measured)
    out["offloaded_optimizer_state"] = host
    out["optimizer_state"] = max(0, measured["optimizer_state"] - host)
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
    return out


def attach_offload(optimizers: list[Optimizer], sharded: list[Optional[ShardedOptimizer]]) -> list[OptimizerOffload]:
    """Offload every optimizer (the user's, not Lightning's wrappers; the strategy's ``setup_optimizers``);
    ``sharded[i]`` is optimizer ``i``'s ZeRO wrapper, or None at ZeRO-3. Raises :class:`HybridConfigError` alike on
    every rank for an optimizer it cannot replace, before loading DeepSpeed."""
    for optimizer in optimizers:
        check_offloadable(optimizer)
    return [OptimizerOffload(optimizer, z) for optimizer, z in zip(optimizers, sharded)]
