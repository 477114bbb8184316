"""``HybridStrategy``'s options as one tree, each option and its default defined once, and the flat constructor derived
from it.

The tree: :class:`StrategyOptions` holds the strategy's own settings, the layout request
(:class:`~lightning_hybrid.layout.LayoutRequest`: the sizes, and the ``tensor_parallel``, ``pipeline`` and ``zero``
sections) and the ``checkpoint`` section (``lightning_hybrid.config``). Each field there is the one place an option is
written: its name, type, default and help (the docstring under it). Everything else is read from them:

- the flat constructor (:func:`flat_options`): the sizes and settings by their field names; a section's fields by
  :func:`~lightning_hybrid.config.flat_argument`'s rule (``PipelineOptions.schedule`` is ``pipeline_schedule``), each
  section also taken whole by its keyword (``pipeline=PipelineOptions(...)``);
- ``HybridStrategy.__init__``'s signature and its docstring's ``Arguments`` (:func:`flat_constructor`), which
  LightningCLI/jsonargparse read for ``--help``, type checking and YAML (``init_args``);
- the check of what was given (:meth:`StrategyOptions.from_flat`): each section built once from its flat arguments
  and the section object given (``config.build_section``), every check run at construction, on every rank alike,
  collective-free.

Adding an option is one field (with its docstring) in the tree, plus its use.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple, Optional, Union

from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_hybrid.config import (
    SECTIONS,
    CheckpointOptions,
    build_section,
    check_positive_int,
    checkpoint_mode,
    flat_argument,
)
from lightning_hybrid.layout import LayoutRequest, ParallelLayout, check_auto_layout, check_compile
from lightning_hybrid.monitoring.callback import HybridMonitor
from lightning_hybrid.monitoring.health import check_monitor
from lightning_hybrid.parallelize import ModelOptions
from lightning_hybrid.planning.auto import auto_request
from lightning_hybrid.watchdog import DEFAULT_TIMEOUT, resolve_timeout

__all__ = ["FlatOption", "StrategyOptions", "flat_constructor", "flat_options"]


class FlatOption(NamedTuple):
    """One option as the flat constructor takes it, read from its field in the tree."""

    name: str
    """The constructor's (and YAML's ``init_args``) name."""
    annotation: Any
    """Its type, as the field's."""
    default: Any
    """Its default, the field's."""
    doc: str
    """Its help, the field's docstring."""
    section: Optional[str] = None
    """The section that also takes it, as ``Class.field`` (``"PipelineOptions.schedule"``); None: flat only."""


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """Everything :class:`~lightning_hybrid.HybridStrategy` takes, checked: the root of the option tree.

    Example:
        >>> options = StrategyOptions.from_flat({"tensor_parallel_size": 2, "pipeline_schedule": "gpipe"})
        >>> options.request.tensor_parallel_size, options.request.pipeline.schedule
        (2, 'gpipe')
    """

    request: LayoutRequest = field(default_factory=LayoutRequest)
    """The layout as asked for (``layout="auto"`` replaces its sizes once the world size is known); its fields are
    flat constructor arguments by their own names."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """How checkpoints are written and checked, and the weights training starts from."""
    activation_checkpointing: Union[bool, Literal["full", "selective"]] = False
    """``True``/``"full"``: recompute each block in the backward pass from its input; ``"selective"``: keep matmul,
    attention and collective outputs, recompute the rest (``SelectivePolicy``). Needs the block list."""
    activation_checkpointing_every: int = 1
    """Checkpoint every N-th block only (1: all of them)."""
    transformer_blocks: Optional[str] = None
    """Name of the repeated block list, when it cannot be found automatically (the pipeline, activation
    checkpointing, the automatic tensor-parallel plan and sequence parallel need one)."""
    compile: bool = False
    """``torch.compile`` each transformer block in place (regional compilation: one compiled graph per block type,
    reused by every block), after tensor parallel and activation checkpointing, before ZeRO-3 (docs/compile.md)."""
    track_gradient_norm: bool = False
    """Take the global gradient norm (before clipping) every step into ``strategy.last_gradient_norm``;
    :class:`~lightning_hybrid.HybridMonitor` has it taken on its logging steps, clipping on every step."""
    process_group_backend: Optional[str] = None
    """The process group backend; None: ``"nccl"`` on CUDA, ``"gloo"`` on CPU."""
    timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT
    """How long a collective waits for a rank that does not come (a ``timedelta`` or seconds; None: 10 minutes), on
    every mesh group; a stuck rank then ends the job and every rank says which rank is stuck (docs/reliability.md).
    Kept as a ``timedelta``."""
    health_checks: Union[bool, Any] = True
    """Add :class:`~lightning_hybrid.HealthChecks` to the callbacks (True, False, or an instance): rank-to-device
    map, layout and version agreement, clock skew at start; replica checksums every K steps."""
    monitor: Union[bool, HybridMonitor] = True
    """Add :class:`~lightning_hybrid.HybridMonitor` when the Trainer has a logger (True, False, or an instance, added
    even without a logger)."""
    layout: Optional[Literal["auto"]] = None
    """``"auto"``: train with the planner's best feasible layout for the world size and device memory, logged with its
    memory ledger; no explicit size with it (docs/planning.md)."""
    device_memory: Optional[float] = None
    """GB per device for ``layout="auto"`` on CPU (on CUDA the device's total memory is used)."""

    def __post_init__(self) -> None:
        check_auto_layout(self.layout, self.request)
        check_compile(self.compile, self.request)
        checkpoint_mode(self.activation_checkpointing)
        check_positive_int("activation_checkpointing_every", self.activation_checkpointing_every)
        check_monitor(self.monitor)
        object.__setattr__(self, "timeout", resolve_timeout(self.timeout))

    @classmethod
    def from_flat(cls, arguments: Mapping[str, Any]) -> StrategyOptions:
        """The options from ``HybridStrategy``'s keyword arguments: flat, or a section whole by its keyword. Each
        section is built once from both (``config.build_section``: a flat argument at its default counts as not
        given; one given both ways with different values is a :class:`~lightning_hybrid.HybridConfigError` naming
        both), an argument not given takes its default from the tree, and every check runs now: every rank runs the
        constructor, so all raise alike, before any collective exists.

        Example:
            >>> from lightning_hybrid import ZeroOptions
            >>> options = StrategyOptions.from_flat({"bucket_cap_mb": 50, "zero": ZeroOptions(offload_optimizer=True)})
            >>> options.request.zero.bucket_cap_mb, options.request.zero.offload_optimizer
            (50.0, True)
        """
        known = {option.name for option in flat_options()} | {keyword for keyword, _, _ in section_keywords()}
        for name in arguments:
            if name not in known:  # as Python says it, with the nearest option when the name is a typo
                near = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise TypeError(f"HybridStrategy() got an unexpected keyword argument {name!r}{hint}")
        return _build(cls, arguments)

    def layout_for(
        self, module: Any, *, world_size: int, devices_per_node: int, device: Any, precision: Any
    ) -> ParallelLayout:
        """The layout the strategy trains with: the request resolved against the world size; with ``layout="auto"``,
        first the planner's best feasible layout for this machine (``planning/auto.py``; ``precision``: the precision
        plugin), its choice and ledger logged on rank 0. Collective-free: a bad layout raises on every rank alike.

        Example:
            >>> options = StrategyOptions.from_flat({"tensor_parallel_size": 2})
            >>> layout = options.layout_for(None, world_size=4, devices_per_node=4, device=None, precision=None)
            >>> layout.data_parallel_size
            2
        """
        request = self.request
        if self.layout == "auto":
            request, message = auto_request(
                request,
                module,
                world_size=world_size,
                devices_per_node=devices_per_node,
                device=device,
                device_memory=self.device_memory,
                precision=str(getattr(precision, "precision", "32-true")),
                activation_checkpointing=self.activation_checkpointing,
            )
            rank_zero_info(message)
        return request.resolve(world_size)

    def model_options(self, device: Any, layer_sync: Any) -> ModelOptions:
        """What :func:`~lightning_hybrid.parallelize.parallelize` takes of these options, for this rank's ``device``
        and Lightning's ``layer_sync`` plugin (``Trainer(sync_batchnorm=True)``).

        Example:
            >>> options = StrategyOptions.from_flat({"activation_checkpointing": True})
            >>> options.model_options("cpu", None).activation_checkpointing
            'full'
        """
        return ModelOptions(
            device=device,
            activation_checkpointing=checkpoint_mode(self.activation_checkpointing),
            activation_checkpointing_every=self.activation_checkpointing_every,
            transformer_blocks=self.transformer_blocks,
            compile=self.compile,
            layer_sync=layer_sync,
        )


def _build(node: type, arguments: Mapping[str, Any]) -> Any:
    """The dataclass ``node`` of the tree from the flat ``arguments`` (those not given: the field's default)."""
    values = {}
    for f, kind, hint in _children(node):
        if kind == "section":
            values[f.name] = build_section(f.name, arguments, arguments.get(f.name))
        elif kind == "branch":
            values[f.name] = _build(hint, arguments)
        elif f.name in arguments:
            values[f.name] = arguments[f.name]
    return node(**values)


def _children(node: type) -> Iterator[tuple[Any, str, Any]]:
    """Each field of the tree's dataclass ``node``, as (field, kind, type): a ``"section"`` (one of
    :data:`~lightning_hybrid.config.SECTIONS`, under its keyword), a ``"branch"`` (another dataclass of the tree, whose
    fields are flat by their own names), or an ``"option"``."""
    hints = typing.get_type_hints(node)
    for f in fields(node):
        hint = hints[f.name]
        kind = "section" if SECTIONS.get(f.name) is hint else "branch" if is_dataclass(hint) else "option"
        yield f, kind, hint


@functools.cache
def flat_options(root: type = StrategyOptions) -> tuple[FlatOption, ...]:
    """Every option of the tree under ``root``, flat, in the tree's order: the names ``HybridStrategy`` and YAML take.

    Example:
        >>> [o.name for o in flat_options()][:3]
        ['tensor_parallel_size', 'pipeline_parallel_size', 'data_parallel_size']
        >>> next(o for o in flat_options() if o.name == "pipeline_schedule").section
        'PipelineOptions.schedule'
    """
    found: list[FlatOption] = []
    for f, kind, hint in _children(root):
        if kind == "branch":
            found += flat_options(hint)
        elif kind == "section":
            docs, section_hints = field_docs(hint), typing.get_type_hints(hint)
            found += [
                FlatOption(flat_argument(f.name, s.name), section_hints[s.name], s.default, docs.get(s.name, ""),
                           f"{hint.__name__}.{s.name}")
                for s in fields(hint)
            ]  # fmt: skip
        else:
            assert f.default is not MISSING, f"{root.__name__}.{f.name}: a flat option needs a default"
            found.append(FlatOption(f.name, hint, f.default, field_docs(root).get(f.name, "")))
    names = [o.name for o in found]
    assert len(set(names)) == len(names), f"two options of {root.__name__}'s tree have one flat name: {names}"
    return tuple(found)


@functools.cache
def section_keywords(root: type = StrategyOptions) -> tuple[tuple[str, type, str], ...]:
    """(keyword, section class, help) of each typed section under ``root``, in the tree's order.

    Example:
        >>> [keyword for keyword, _, _ in section_keywords()]
        ['tensor_parallel', 'pipeline', 'zero', 'checkpoint']
    """
    found: list[tuple[str, type, str]] = []
    for f, kind, hint in _children(root):
        if kind == "branch":
            found += section_keywords(hint)
        elif kind == "section":
            names = ", ".join(f"``{s.name}``" for s in fields(hint))
            doc = f"{field_docs(root).get(f.name, '')} As one :class:`~lightning_hybrid.{hint.__name__}` ({names})."
            found.append((f.name, hint, doc.strip()))
    return tuple(found)


@functools.cache
def field_docs(node: type) -> dict[str, str]:
    """Each field's docstring (the string under it) of the dataclass ``node``, read from its source: the help the
    flat constructor shows. Empty where the source cannot be read.

    Example:
        >>> field_docs(CheckpointOptions)["async_checkpoint"].split(" (")[0]
        'Write checkpoints in the background'
    """
    try:
        source = inspect.getsource(sys.modules[node.__module__])
    except (OSError, TypeError, KeyError):
        return {}
    for definition in ast.walk(ast.parse(source)):
        if isinstance(definition, ast.ClassDef) and definition.name == node.__name__:
            body = definition.body
            return {
                target.target.id: inspect.cleandoc(doc.value.value)
                for target, doc in zip(body, body[1:])
                if isinstance(target, ast.AnnAssign) and isinstance(target.target, ast.Name) and _is_string(doc)
            }
    return {}


def _is_string(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def flat_constructor(base_init: Callable[..., None]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``__init__(self, options: StrategyOptions, **base)`` the flat constructor: it takes every option by keyword
    (flat, or a section whole) besides ``base_init``'s own arguments (Lightning's ``ParallelStrategy``), builds and
    checks the options from them (:meth:`StrategyOptions.from_flat`) and passes ``base_init``'s on. Its signature
    (``__signature__``, ``__annotations__``) and its docstring's ``Arguments`` are read from the tree, every argument
    keyword-only: ``inspect.signature``, ``typing.get_type_hints`` and LightningCLI's jsonargparse read them as if
    written by hand (``--help`` with each option's help, type and default; types checked; YAML ``init_args``).

    Example:
        >>> @flat_constructor(lambda self, accelerator=None: None)
        ... def init(self, options, accelerator=None):
        ...     "Made from the options."
        ...     print(options.request.tensor_parallel_size, accelerator)
        >>> list(inspect.signature(init).parameters)[1:4]
        ['tensor_parallel_size', 'pipeline_parallel_size', 'data_parallel_size']
        >>> init(None, tensor_parallel_size=2, accelerator="cpu")
        2 cpu
    """
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    base_hints = typing.get_type_hints(base_init)
    base = [p.replace(kind=keyword_only, annotation=base_hints.get(p.name, p.annotation))
            for p in list(inspect.signature(base_init).parameters.values())[1:]]  # fmt: skip
    parameters = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(inspect.Parameter(o.name, keyword_only, default=o.default, annotation=o.annotation) for o in flat_options()),
        *(inspect.Parameter(k, keyword_only, default=None, annotation=Optional[c]) for k, c, _ in section_keywords()),
        *base,
    ]
    docs = [(o.name, f"{o.doc} (In its section: ``{o.section}``.)" if o.section else o.doc) for o in flat_options()]
    docs += [(name, doc) for name, _, doc in section_keywords()]
    indent = {"initial_indent": "    ", "subsequent_indent": "        ", "break_on_hyphens": False}
    arguments = "\n".join(textwrap.fill(f"{name}: {' '.join(doc.split())}", 116, **indent) for name, doc in docs)
    base_names = [p.name for p in base]

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        def flat_init(self: Any, **given: Any) -> None:
            passed_on = {name: given.pop(name) for name in base_names if name in given}
            init(self, StrategyOptions.from_flat(given), **passed_on)

        for name in ("__module__", "__name__", "__qualname__"):
            setattr(flat_init, name, getattr(init, name))
        flat_init.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        flat_init.__annotations__ = {p.name: p.annotation for p in parameters[1:]} | {"return": None}
        flat_init.__doc__ = f"{inspect.cleandoc(init.__doc__ or '')}\n\nArguments:\n{arguments}\n"
        return flat_init

    return decorate
