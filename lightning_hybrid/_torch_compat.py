"""Every private torch name the package leans on, in one place.

A new torch release breaks the package here first, and only here. Each entry says what the name is, the torch
versions it was checked on, and the public API to switch to once torch has one. No other module of the package
imports a private torch name or reads a private torch attribute; they call these.

Checked on: torch 2.11.0 (the lower bound in ``pyproject.toml``) and torch 2.13.0; each name below exists, with the
signature used here, in both.

Not private, so not here: the ``_apply`` method that every ``ParallelStyle`` subclass implements
(``tensor_parallel/styles.py``): it is the abstract method torch's ``parallelize_module`` calls, the documented way
to write a style.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "WRAPPER_PREFIXES",
    "AsyncCollectiveTensor",
    "all_to_all_autograd",
    "BatchNormBase",
    "TorchDispatchMode",
    "colwise_input_fn",
    "style_output_fn",
    "compute_local_shape_and_global_offset",
    "dtensor_local_data",
    "extension_build_directory",
    "fake_tensor_mode",
    "flight_recorder_dumper",
    "group_options",
    "inside_backward",
    "is_strided_shard",
    "copy_with_child",
    "module_children",
    "module_parameters",
    "mark_optimizer_stepped",
    "mark_step_reports_itself",
    "non_finite_check_and_unscale_",
    "op_argument_names",
    "op_name",
    "privateuse1_backend_name",
    "reinstall_tensor_hooks",
    "queue_autograd_callback",
    "resolve_process_group",
    "strided_shard",
    "tensor_version",
    "META_SKIPPING_INITIALIZERS",
    "device_constructors",
    "storage_identity",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "unboxed_process_group",
    "unboxed_work",
    "DISABLED_TORCH_FUNCTION",
    "make_wrapper_tensor",
    "torch_function_disabled",
    "written_arguments",
]

# --- DTensor --------------------------------------------------------------------------------------------------------

# ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset(shape, mesh, placements)``: this rank's
# local shape and its offset in the global tensor, for any placements (strided shards included). Used by the
# checkpoint code to cut a full tensor into this rank's piece. Public replacement: none yet (DTensor has no
# ``local_offset``); switch when ``torch.distributed.tensor`` exports one.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402


def strided_shard(dim: int, blocks: int) -> Any:
    """The placement "split each of ``blocks`` equal blocks of ``dim``" over one mesh dimension.

    ``torch.distributed.tensor.placement_types._StridedShard(dim, split_factor=blocks)``: the placement FSDP2 + TP
    uses for this layout; checkpoints see the unpermuted tensor through it. Public replacement: none yet (torch
    2.13 still keeps it private); switch when ``torch.distributed.tensor`` exports a strided shard.

    Example:
        >>> strided_shard(0, 3).dim
        0
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=blocks)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (see :func:`strided_shard`), ours or FSDP2's own.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> is_strided_shard(strided_shard(0, 3)), is_strided_shard(Shard(0))
        (True, False)
    """
    return type(placement).__name__ == "_StridedShard"


def dtensor_local_data(t: Tensor) -> Tensor:
    """A DTensor's local tensor read without ``DTensor.to_local()`` (no autograd call: cheap enough per tensor per
    step for measuring); a plain tensor itself. Writes to it write the DTensor.

    ``DTensor._local_tensor``: the slot holding the local shard. Public replacement: ``DTensor.to_local()``, which
    costs an autograd function call per tensor.

    Example:
        >>> dtensor_local_data(torch.zeros(2)).shape
        torch.Size([2])
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def tensor_version(t: Tensor) -> int:
    """``Tensor._version``: the counter autograd bumps on every in-place write to the tensor's storage. Used to see
    that a device tensor changed behind an offloaded copy (a checkpoint load). Public replacement: none.

    Example:
        >>> t = torch.zeros(1); v = tensor_version(t); _ = t.add_(1); tensor_version(t) > v
        True
    """
    return t._version


# --- tensor parallel ------------------------------------------------------------------------------------------------


def make_wrapper_tensor(
    cls: type,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    strides: Optional[tuple[int, ...]] = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of class ``cls`` with ``shape``, ``dtype`` and ``device`` and no storage: a wrapper whose values live
    elsewhere (the vocabulary-parallel logits' shards) or nowhere (a pipeline's stand-ins for another stage's output).
    ``torch.Tensor._make_wrapper_subclass``, what DTensor is made with. Checked on torch 2.11 and 2.13. Public
    replacement: none.

    Example:
        >>> # made = make_wrapper_tensor(StandIn, (2, 3), torch.float32, torch.device("cpu"))  # a dispatch class
    """
    return Tensor._make_wrapper_subclass(
        cls, shape, strides=strides, dtype=dtype, device=device, requires_grad=requires_grad
    )


def torch_function_disabled() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called (a subclass reading its own
    metadata). ``torch._C.DisableTorchFunctionSubclass``. Checked on torch 2.11 and 2.13. Public replacement: none
    (``torch.overrides`` has no context for it).

    Example:
        >>> with torch_function_disabled():
        ...     torch.ones(1).shape
        torch.Size([1])
    """
    return torch._C.DisableTorchFunctionSubclass()


def written_arguments(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments an ``OpOverload`` writes to (in-place and ``out=`` arguments), from its
    schema's alias information: ``OpOverload._schema``. Checked on torch 2.11 and 2.13. Public replacement: none.

    Example:
        >>> written_arguments(torch.ops.aten.add_.Tensor)
        [(0, 'self')]
    """
    arguments = enumerate(func._schema.arguments)
    return [(i, a.name) for i, a in arguments if a.alias_info is not None and a.alias_info.is_write]


def colwise_input_fn(style: Any) -> Callable[..., Any]:
    """The input hook torch's ``ColwiseParallel`` installs, for a subclass that distributes the module itself:
    ``ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)``, bound to
    ``style``'s layouts (``RowwiseParallel._prepare_input_fn`` is the same code, so it serves a row-wise style too).
    Public replacement: none (a ``ParallelStyle`` has no public input hook); switch to one when torch's parallel
    styles expose it.

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> callable(colwise_input_fn(ColwiseParallel()))
        True
    """
    from torch.distributed.tensor.parallel import ColwiseParallel

    return partial(ColwiseParallel._prepare_input_fn, style.input_layouts, style.desired_input_layouts)


def style_output_fn(style: Any) -> Callable[..., Any]:
    """The output hook torch's ``ColwiseParallel`` and ``RowwiseParallel`` install (the same code in both: redistribute
    the output to ``output_layouts``, then take its local tensor if ``use_local_output``), for a subclass that
    distributes the module itself: ``ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod,
    outputs, device_mesh)``, bound to ``style``'s layouts. Public replacement: none, as for :func:`colwise_input_fn`.

    Example:
        >>> from torch.distributed.tensor.parallel import RowwiseParallel
        >>> callable(style_output_fn(RowwiseParallel()))
        True
    """
    from torch.distributed.tensor.parallel import ColwiseParallel

    return partial(ColwiseParallel._prepare_output_fn, style.output_layouts, style.use_local_output)


# --- autograd -------------------------------------------------------------------------------------------------------


def inside_backward() -> bool:
    """Whether this code runs inside a backward pass (an activation-checkpointed block's recomputed forward, a
    gradient hook): ``torch._C._current_graph_task_id() != -1``. Public replacement: none in 2.11-2.13."""
    return torch._C._current_graph_task_id() != -1


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (call it from inside a gradient hook), as DDP does to
    wait for its last buckets.

    ``torch.autograd.Variable._execution_engine.queue_callback``. Public replacement: none in 2.11-2.13 (FSDP2 and
    DDP use the same call); switch when ``torch.autograd`` exports one.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply ``grads`` (one dtype and device) by
    ``inv_scale`` in place and set ``found_inf`` to 1 if any is inf/NaN, in one fused kernel. ``GradScaler.unscale_``
    calls the same op. Public replacement: ``torch.amp.GradScaler`` itself, which cannot be handed a gradient list.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# ``torch.optim`` LR schedulers wrap ``optimizer.step`` to mark that it ran (``optimizer._opt_called``), and warn
# when ``scheduler.step()`` comes first; a step function marked ``_wrapped_by_lr_sched`` is not wrapped again.
# Public replacement: none (``torch.optim.lr_scheduler`` internals, unchanged 2.11-2.13).
def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell torch's LR schedulers that ``optimizer`` stepped, from a step function that replaced
    ``optimizer.step`` (see :func:`mark_step_reports_itself`)."""
    optimizer._opt_called = True


def mark_step_reports_itself(step: Callable[..., Any]) -> None:
    """Mark a replacement ``optimizer.step`` as one that calls :func:`mark_optimizer_stepped` itself, so that torch's
    LR schedulers do not wrap it."""
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


# module wrappers that torch inserts into parameter names but not into state-dict keys: activation checkpointing's
# ``_CHECKPOINT_PREFIX`` (torch.distributed.algorithms._checkpoint.checkpoint_wrapper), FSDP1's
# ``FSDP_WRAPPED_MODULE`` (torch.distributed.fsdp._common_utils) and ``torch.compile``'s ``OptimizedModule._orig_mod``.
# Public replacement: ``torch.distributed.checkpoint.state_dict`` maps these itself; switch where it covers the case.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


# --- c10d -----------------------------------------------------------------------------------------------------------


def unboxed_process_group(boxed: Any) -> Any:
    """The ``ProcessGroup`` a ``torch.ops.c10d`` operation receives (a ``ScriptObject`` as a dispatch mode sees it):
    ``ProcessGroup.unbox``, a static method torch's own dispatch-mode tools use (``_tools/fake_collectives.py``).
    Checked on torch 2.13. Public replacement: none documented (switch when ``torch.distributed`` documents one)."""
    return dist.ProcessGroup.unbox(boxed)


def unboxed_work(boxed: Any) -> Any:
    """The ``Work`` a ``torch.ops.c10d`` operation returns, as a dispatch mode sees it (a ``ScriptObject``):
    ``Work.unbox``, the counterpart of :func:`unboxed_process_group`. Checked on torch 2.13. Public replacement:
    none documented."""
    return dist.Work.unbox(boxed)


def op_argument_names(func: Any) -> list[str]:
    """The argument names of an ``OpOverload``'s schema (``func._schema.arguments``), to find an argument by name
    once per operation. Checked on torch 2.11 and 2.13. Public replacement: none (the schema is the operation's
    only signature).

    Example:
        >>> op_argument_names(torch.ops.aten.add.Tensor)
        ['self', 'other', 'alpha']
    """
    return [a.name for a in func._schema.arguments]


def resolve_process_group(name: str) -> Any:
    """The process group a functional collective names by string:
    ``torch.distributed.distributed_c10d._resolve_process_group``. Public replacement: none in 2.11-2.13."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def op_name(func: Any) -> str:
    """An ``OpOverload``'s op name without namespace and overload (``_c10d_functional.all_reduce.default`` ->
    ``all_reduce``): ``OpOverload._opname``. Public replacement: ``func._schema.name`` is no better (private too);
    ``str(func.overloadpacket)`` carries the namespace.

    Example:
        >>> op_name(torch.ops.aten.add.Tensor)
        'add'
    """
    return func._opname


def group_options(backend: str, timeout: timedelta) -> Any:
    """Options for a new process group of ``backend`` ("nccl" or "gloo") with ``timeout``.

    ``ProcessGroupGloo._Options`` (gloo's options class has no public name) and the options' ``_timeout`` field
    (NCCL's too). Public replacement: ``new_group(timeout=...)``, which DeviceMesh does not take per dimension."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def flight_recorder_dumper(backend: str) -> Optional[Callable[[bool, bool], str]]:
    """torch's flight-recorder dump for ``backend`` as a JSON-string function ``(include_collectives,
    include_stack_traces)``, or None where this torch build has none.

    ``torch._C._distributed_c10d._dump_nccl_trace_json`` (NCCL builds) and ``_dump_fr_trace_json`` (every backend).
    Public replacement: none; torch's ``torch.distributed.flight_recorder`` reads dump files, not a live process."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace_json", None) if backend == "nccl" else None
    return dump or getattr(c10d, "_dump_fr_trace_json", None)


# ``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees every ATen op below autograd
# (torch's own ``CommDebugMode`` is one). Public replacement: none yet (documented, but in a private module).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def _async_collective_tensor() -> type:
    # the tensor subclass a functional collective returns before ``wait_tensor``
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor


# ``torch.distributed._functional_collectives.AsyncCollectiveTensor``. Public replacement: none.
AsyncCollectiveTensor = _async_collective_tensor()


def all_to_all_autograd(tensor: Tensor, receive: list[int], send: list[int], group: Any) -> Tensor:
    """Rows of ``tensor`` sent by ``send`` counts, ``receive`` counts received, differentiable (the gradient goes back
    the reverse way): ``torch.distributed._functional_collectives.all_to_all_single_autograd``, waited for. Public
    replacement: ``torch.distributed.nn.functional.all_to_all_single``, deprecated in its favour since torch 2.13."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(tensor, receive, send, group))


# --- devices, norms, extensions -------------------------------------------------------------------------------------


def privateuse1_backend_name() -> str:
    """The name an out-of-tree device registered for the PrivateUse1 key ("privateuseone" when none did):
    ``torch._C._get_privateuse1_backend_name``. Public replacement: none in 2.11-2.13.

    Example:
        >>> isinstance(privateuse1_backend_name(), str)
        True
    """
    return torch._C._get_privateuse1_backend_name()


def _batch_norm_base() -> type:
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


# ``torch.nn.modules.batchnorm._BatchNorm``: the base of BatchNorm1d/2d/3d, exactly what
# ``SyncBatchNorm.convert_sync_batchnorm`` converts. Public replacement: none (``nn.modules.batchnorm`` exports only
# the concrete classes).
BatchNormBase = _batch_norm_base()


def extension_build_directory(name: str) -> str:
    """Where torch's C++ extension loader builds (and caches) the extension ``name``:
    ``torch.utils.cpp_extension._get_build_directory``. Public replacement: none (the ``TORCH_EXTENSIONS_DIR``
    variable sets the root, not the per-extension folder)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


# --- nn.Module internals ------------------------------------------------------------------------------------------


def module_children(module: nn.Module) -> dict[str, nn.Module]:
    """``Module._modules``: the live table of a module's children, written to swap a child for the length of one
    pipeline stage's forward (``setattr`` checks parameters, buffers and submodules on every call; a stage swaps
    modules per micro-batch). Checked on torch 2.11 and 2.13. Public replacement: ``register_module`` /
    ``setattr`` (correct, slower); none gives the table itself."""
    return module._modules  # type: ignore[return-value]


def copy_with_child(module: nn.Module, name: str, child: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (every attribute shared) whose child ``name`` is ``child``; ``module`` itself
    keeps its own (a table of its own for the copy's children). Checked on torch 2.11 and 2.13. Public replacement:
    none (``setattr`` on a shallow copy would write the table both share)."""
    shallow = copy.copy(module)
    shallow._modules = {**module._modules, name: child}
    return shallow


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``Module._parameters``: the parameters registered on ``module`` itself, read live (FSDP2 swaps sharded and
    unsharded tensors in) without walking the tree. Checked on torch 2.11 and 2.13. Public replacement:
    ``module.named_parameters(recurse=False)`` (a generator per call, slower per step)."""
    return module._parameters  # type: ignore[return-value]


# --- recording a construction on the meta device (construction/record.py) --------------------------------------------

# ``torch.utils._pytree.tree_flatten`` / ``tree_map``: walk the nested arguments of an ATen call. Checked on torch 2.11
# and 2.13. Public replacement: ``torch.utils.pytree`` (public from torch 2.11 on as an alias, not yet in every
# release this package supports with the same functions); switch once the lower bound has it.
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402


def device_constructors() -> set[Any]:
    """``torch.utils._device._device_constructors()``: the factory functions that ``torch.device(...)`` as a context
    redirects. Checked on torch 2.11 and 2.13. Public replacement: none (``torch.device`` as a context manager uses
    it internally)."""
    from torch.utils._device import _device_constructors

    return set(_device_constructors())


@contextmanager
def fake_tensor_mode() -> Generator[None, None, None]:
    """``torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)``: while active, tensors made are
    fake, holding no memory and no values but reporting a real device, so that the device's autocast applies to them
    (meta tensors take no autocast: a trace on them shows fp32 where a bf16-mixed step computes bf16); real tensors
    the code reads (a module's plain tensor attribute) are taken as constants. The pipeline's trace of the unsplit
    network uses it under autocast; an op whose meta kernel refuses its inputs is the trace's failure, expected
    (``_grouped_mm`` wants bf16 there), so the mode's own error log of it is kept quiet meanwhile. Checked on torch
    2.11 and 2.13. Public replacement: none (``torch._subclasses`` is what ``torch.export`` and ``torch.compile``
    trace with)."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    logger = logging.getLogger(FakeTensorMode.__module__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        logger.setLevel(level)


def reinstall_tensor_hooks(t: Tensor) -> None:
    """``t._backward_hooks`` and ``t._post_accumulate_grad_hooks``: the hooks ``register_hook`` and
    ``register_post_accumulate_grad_hook`` keep on the Python tensor, which their setters install on the tensor's
    autograd record. ``torch.utils.swap_tensors`` (and ``nn.Module._apply``, which swaps tensor subclasses) exchanges
    that record and leaves the hooks with the old one; setting the same hooks again installs them on the new one
    (the setters replace, so a tensor whose hooks were not lost keeps one copy). Checked on torch 2.13; both
    attributes exist since torch 2.1. Public replacement: none."""
    for attribute in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, attribute, None)
        if hooks:
            setattr(t, attribute, hooks)


def storage_identity(t: Tensor) -> int:
    """``t.untyped_storage()._cdata``: the address of the storage behind ``t``, shared by all its views, also on the
    meta device (where ``data_ptr()`` is 0 for every tensor). Checked on torch 2.11 and 2.13. Public replacement:
    none for meta tensors."""
    return t.untyped_storage()._cdata


# ``torch.nn.init``'s functions that return a meta tensor untouched (their sampling reads values: rejection in
# ``trunc_normal_``, a QR decomposition in ``orthogonal_``), looked up by name through the module's globals, so that
# a recording can stand in for them also where a model imported the public function itself
# (``_no_grad_trunc_normal_`` is what the public ``trunc_normal_`` calls). Checked on torch 2.11 and 2.13. Public
# replacement: none.
META_SKIPPING_INITIALIZERS = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")


# --- tensor subclasses (pipeline/stand_in.py) ------------------------------------------------------------------------

# ``torch._C._disabled_torch_function_impl``: a subclass's ``__torch_function__`` that leaves every call to
# ``__torch_dispatch__`` (without it each call first goes through the Python subclass machinery). Checked on torch 2.11
# and 2.13. Public replacement: none.
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
