"""Finding a block's tensor-parallel plan from the data flow of one forward, when layer names do not tell it.

One forward of the example input runs up to the end of the first block, with every torch function watched
(``TorchFunctionMode``): each tensor carries the set of the block's linear layers it was computed from. A full-width
normalization (the residual stream's norm) clears the set, so each projection's input shows which projections feed it
directly:

- a layer fed by other projections of the block closes a split region (row-wise), and those projections open it
  (column-wise): q, k, v -> o_proj; gate, up -> down; fc -> proj;
- a column-wise projection whose output is first reshaped into ``(heads, head_dim)`` keeps whole heads under a plain
  split (per-head interleaved fused qkv); one whose output is first split into ``k`` equal parts along the features is
  a fused projection (``fused_colwise_k``); unequal parts cannot be split exactly and are refused;
- a chain of three or more projections, or a projection feeding two regions, is not decided: the error prints what
  was found and the dict the user completes;
- a region may close in a sibling module of the one that opens it (BERT: ``attention.self.{query,key,value}`` ->
  ``attention.output.dense``), provided nothing else reads the sharded activation on the way: no torch function of
  the parent's own code or of the sibling's before its row-wise projection (a norm, a residual add) may take it, and
  only parameter-free modules (dropout) of the sibling may; anywhere in a region, a module with a parameter as wide
  as the sharded features (a norm over them) is refused, because each rank would see only its shard of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid._hooks import tensors_in
from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.tensor_parallel.styles import is_projection, projection_features

__all__ = ["BlockPlan", "check_block_plan", "discover_block_plan", "fused_split_problems"]


class BlockPlan(NamedTuple):
    """A block's plan: style names by layer, and the modules that compute on a rank's shard between a column- and a
    row-wise split (their replicated parameters' gradients are one rank's share, summed over the ranks)."""

    styles: dict[str, str]
    inside_split: list[str]
    # each row-wise projection -> the column-wise projections whose sharded outputs it reads
    regions: dict[str, list[str]] = {}


_SPLITS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
_RESHAPES = {"view", "reshape", "unflatten"}
_PASS_THROUGH = {"to", "contiguous", "clone", "float", "half", "bfloat16", "type_as", "dropout"}


class _StopAfterBlock(BaseException):
    """Ends the discovery forward once the first block has run: nothing after it is needed. A ``BaseException``, as
    ``GeneratorExit`` is: a forward that wraps its network call in ``try/except Exception`` would otherwise catch it
    (and the plan would be refused, or left unchecked, for the user's error)."""


class _DataFlow(TorchFunctionMode):
    """Propagates, through every torch function, the set of projections each tensor was computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, frozenset[str]] = {}
        self.keep: list[Tensor] = []  # ids stay unique while the tensors live
        self.produced_by: dict[int, str] = {}  # a projection's own output -> its name
        self.first_use: dict[str, tuple[str, Any]] = {}  # projection -> how its output is first consumed
        self.stack: list[str] = []  # the block's modules running now, innermost last ("" is the block itself)
        # every torch function taking a tensor computed from projections: (innermost module, function, sources)
        self.reads: list[tuple[str, str, frozenset[str]]] = []

    def mark(self, tensor: Tensor, sources: frozenset[str]) -> None:
        self.sources[id(tensor)] = sources
        self.keep.append(tensor)

    def sources_of(self, value: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for t in tensors_in(value):
            found |= self.sources.get(id(t), frozenset())
        return found

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if args and isinstance(args[0], Tensor) and id(args[0]) in self.produced_by and tensors_in(out):
            name, fname = self.produced_by[id(args[0])], getattr(func, "__name__", "")
            if fname in _PASS_THROUGH and isinstance(out, Tensor) and out.shape == args[0].shape:
                self.produced_by[id(out)] = name  # still the projection's output, as far as its layout goes
                self.keep.append(out)
            elif name not in self.first_use:
                self.first_use[name] = _describe_use(fname, args[0], out)
        sources = self.sources_of((args, kwargs))
        if sources:
            if self.stack:
                self.reads.append((self.stack[-1], getattr(func, "__name__", str(func)), sources))
            for t in tensors_in(out):
                self.mark(t, sources)
        return out


def _describe_use(func: str, tensor: Tensor, out: Any) -> tuple[str, Any]:
    """How a projection's output is first consumed: ("heads", n), ("split", sizes), or ("other", func)."""
    features = tensor.shape[-1]
    outs = tensors_in(out)
    if func in _RESHAPES and outs and outs[0].dim() > tensor.dim():
        shape = outs[0].shape
        if shape[-2] * shape[-1] == features and shape[-2] > 1:
            return ("heads", int(shape[-2]))
    if func in _SPLITS and len(outs) > 1 and all(o.dim() == tensor.dim() for o in outs):
        sizes = [int(o.shape[-1]) for o in outs]
        if sum(sizes) == features:
            return ("split", sizes)
    if func == "__getitem__" and outs and outs[0].dim() == tensor.dim() and outs[0].shape[-1] < features:
        return ("slice", int(outs[0].shape[-1]))
    return ("other", func)


def _is_full_width_norm(module: nn.Module, width: int) -> bool:
    if not (isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.lower().endswith("norm")):
        return False
    weight = getattr(module, "weight", None)
    return weight is None or (isinstance(weight, Tensor) and weight.shape[-1:] == (width,))


def discover_block_plan(root: nn.Module, block_name: str, example_input: Any) -> BlockPlan:
    """The plan of the block ``block_name`` (names relative to it), found from one forward of ``example_input``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm, self.proj = nn.LayerNorm(8), nn.Linear(16, 8)
        ...         self.fc_1, self.fc_2 = nn.Linear(8, 16), nn.Linear(8, 16)
        ...     def forward(self, x):
        ...         h = self.norm(x)
        ...         return x + self.proj(torch.nn.functional.silu(self.fc_1(h)) * self.fc_2(h))
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([MLP()]))
        >>> net.forward = lambda x: net[1][0](net[0](x))
        >>> discover_block_plan(net, "1.0", torch.zeros(2, 4)).styles
        {'proj': 'rowwise', 'fc_1': 'colwise', 'fc_2': 'colwise'}
    """
    block = root.get_submodule(block_name)
    trace = _trace(root, block_name, example_input)
    projections, inputs, fed_by = trace.projections, trace.inputs, trace.fed_by
    styles = _decide(block_name, projections, inputs, trace.first_use)
    openers = {n for n, style in styles.items() if style != "rowwise"}
    closers = [n for n, style in styles.items() if style == "rowwise"]
    regions = {c: sorted(inputs[c] & openers, key=list(projections).index) for c in closers}
    _check_regions(block_name, block, projections, styles, regions, fed_by, trace.reads, trace.block_output)
    # modules computing on a shard: fed by a column-wise split, neither a row-wise one nor a module holding one
    # (BERT's BertSelfOutput takes the sharded input, but its norm runs after the row-wise split, replicated)
    inside = [
        n for n, sources in fed_by.items()
        if sources & openers and styles.get(n) != "rowwise" and not any(c.startswith(n + ".") for c in closers)
    ]  # fmt: skip
    return BlockPlan(styles, inside, regions)


def check_block_plan(
    root: nn.Module, block_name: str, example_input: Any, styles: dict[str, str]
) -> dict[str, list[str]]:
    """Check a plan found another way (by layer names, or a dict) against the data flow of one forward, as a plan
    found from the data flow is checked: each fused projection's parts (:func:`fused_split_problems`), and each
    region's sharded activation read by nothing that needs it whole (a norm over the sharded features; on the way to
    a sibling module, anything). ``styles``: the block's split layers (names in the block) -> ``"colwise"``,
    ``"fused_colwise_<k>"`` or ``"rowwise"``. Returns the regions the data flow shows: each row-wise split -> the
    column-wise splits whose outputs it reads.

    Example:
        >>> net = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))]))
        >>> net.forward = lambda x: net[0][0](x)
        >>> check_block_plan(net, "0.0", torch.zeros(2, 4), {"0": "colwise", "2": "rowwise"})
        {'2': ['0']}
    """
    block = root.get_submodule(block_name)
    trace = _trace(root, block_name, example_input)
    fused = {n: int(s.rsplit("_", 1)[1]) for n, s in styles.items() if s.startswith("fused_colwise_")}
    problems = _fused_problems(block_name, trace.first_use, fused)
    if problems:
        raise HybridConfigError(
            f"The tensor-parallel plan splits fused projections of {block_name!r} (found by their names, or given as"
            f" 'fused_colwise_<k>'), but {'; '.join(problems)}: no tensor-parallel layout splits each part of such a"
            " weight exactly. Leave the attention replicated: give `tensor_parallel_plan` as a dict naming only the"
            " MLP layers."
        )
    openers = [n for n, style in styles.items() if style != "rowwise"]
    regions = {
        closer: [o for o in openers if o in trace.inputs.get(closer, frozenset())]
        for closer, style in styles.items()
        if style == "rowwise"
    }
    regions = {c: found for c, found in regions.items() if found}
    _check_regions(block_name, block, trace.projections, styles, regions, trace.fed_by, trace.reads, [])
    return regions


def fused_split_problems(root: nn.Module, block_name: str, example_input: Any, fused: dict[str, int]) -> list[str]:
    """Check layers a plan splits as ``k`` equal fused blocks (``fused``: name in the block -> ``k``, from their names)
    against the split the forward actually makes of their output; returns what does not match.

    A name does not tell the parts: litgpt's ``qkv`` under grouped-query attention holds unequal q|k|v, GPTBigCode's
    multi-query ``c_attn`` q|kv, and a per-head interleaved ``qkv`` is reshaped into heads, not split.

    Example:
        >>> class Attn(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qkv, self.proj = nn.Linear(8, 16), nn.Linear(8, 8)
        ...     def forward(self, x):
        ...         q, k, v = self.qkv(x).split([8, 4, 4], dim=-1)
        ...         return self.proj(q * k.repeat(1, 2) + v.repeat(1, 2))
        >>> net = nn.Sequential(nn.ModuleList([Attn()]))
        >>> net.forward = lambda x: net[0][0](x)
        >>> fused_split_problems(net, "0.0", torch.zeros(2, 8), {"qkv": 3})
        ["'0.0.qkv' is split into the parts [8, 4, 4] by the forward, not 3 equal ones"]
    """
    return _fused_problems(block_name, _trace(root, block_name, example_input).first_use, fused)


def _fused_problems(block_name: str, uses: dict[str, tuple[str, Any]], fused: dict[str, int]) -> list[str]:
    problems = []
    for name, blocks in fused.items():
        use, where = uses.get(name, ("other", None)), f"{block_name}.{name}"
        if use[0] == "split" and len(use[1]) == blocks and len(set(use[1])) == 1:
            continue
        if use[0] == "split":
            problems.append(f"{where!r} is split into the parts {use[1]} by the forward, not {blocks} equal ones")
        elif use[0] == "heads":
            problems.append(
                f"{where!r}'s output is reshaped into {use[1]} heads, not split into {blocks} parts (a per-head"
                " interleaved projection: give it 'colwise')"
            )
        else:
            problems.append(f"{where!r}'s output is first taken by {use[1]!r}, not split into {blocks} equal parts")
    return problems


class _Trace(NamedTuple):
    projections: dict[str, nn.Module]
    inputs: dict[str, frozenset[str]]  # projection -> the projections its input comes from
    first_use: dict[str, tuple[str, Any]]
    fed_by: dict[str, frozenset[str]]  # every module of the block -> the projections its input comes from
    reads: list[tuple[str, str, frozenset[str]]]
    block_output: list[frozenset[str]]


def _trace(root: nn.Module, block_name: str, example_input: Any) -> _Trace:
    """One forward of ``example_input`` up to the end of the block ``block_name``, its data flow recorded."""
    block = root.get_submodule(block_name)
    projections = {n: m for n, m in block.named_modules() if n and is_projection(m)}
    flow = _DataFlow()
    inputs: dict[str, frozenset[str]] = {}
    width: list[int] = []
    handles = []

    def on_block_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = next(iter(tensors_in((args, kwargs))), None)
        width.append(int(first.shape[-1]) if first is not None else -1)

    def on_projection(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            inputs.setdefault(name, flow.sources_of(args))
            for t in tensors_in(output):
                flow.mark(t, frozenset({name}))
                flow.produced_by[id(t)] = name

        return hook

    names = {id(m): n for n, m in block.named_modules() if n}
    fed_by: dict[str, frozenset[str]] = {}  # every module of the block -> the projections its input comes from
    block_output: list[frozenset[str]] = []

    def on_module_start(module: nn.Module, args: tuple) -> None:
        flow.stack.append(names.get(id(module), ""))

    def on_module(module: nn.Module, args: tuple, output: Any) -> None:
        if flow.stack:
            flow.stack.pop()
        if id(module) in names:
            fed_by.setdefault(names[id(module)], flow.sources_of(args))
        if width and _is_full_width_norm(module, width[0]):
            for t in tensors_in(output):
                flow.mark(t, frozenset())

    def stop(module: nn.Module, args: tuple, output: Any) -> None:
        # the hidden state only: a block may return its attention weights too (sharded over heads), which the model
        # drops unless it was asked for them
        hidden = tensors_in(output)
        block_output.append(flow.sources_of(hidden[0]) if hidden else frozenset())
        raise _StopAfterBlock

    handles.append(block.register_forward_pre_hook(on_block_input, with_kwargs=True))
    for name, module in projections.items():
        handles.append(module.register_forward_hook(on_projection(name)))
    for module in block.modules():
        handles.append(module.register_forward_pre_hook(on_module_start))
        handles.append(module.register_forward_hook(on_module))
    handles.append(block.register_forward_hook(stop))
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    example = [t.to(device) for t in tensors_in(example_input)] if not isinstance(example_input, Tensor) else None
    # the forward must leave no trace: random streams (dropout) and buffers (running statistics) are put back
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), flow:
            if example is None:
                root(example_input.to(device))
            elif isinstance(example_input, dict):
                root(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in example_input.items()})
            else:
                root(*example)
    except _StopAfterBlock:
        pass
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, b in root.named_buffers():
                b.copy_(buffers[name])
    return _Trace(projections, inputs, flow.first_use, fed_by, flow.reads, block_output)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _within(name: str, scope: str) -> bool:
    return name == scope or name.startswith(scope + ".") or scope == ""


def _check_regions(
    block_name: str,
    block: nn.Module,
    projections: dict[str, nn.Module],
    styles: dict[str, str],
    regions: dict[str, list[str]],
    fed_by: dict[str, frozenset[str]],
    reads: list[tuple[str, str, frozenset[str]]],
    block_output: list[frozenset[str]],
) -> None:
    """Refuse a region whose sharded activation something else reads: a plan that would train, but not exactly."""
    problems: list[str] = []
    for closer, openers in regions.items():
        opened = set(openers)
        widths = set()  # the sharded features' widths: each opener's, and each part of a fused one
        for opener in openers:
            out_features = projection_features(projections[opener])[1]
            parts = int(styles[opener].rsplit("_", 1)[1]) if styles[opener].startswith("fused_colwise_") else 1
            widths |= {out_features, out_features // parts}
        # a module with a parameter as wide as the sharded features: a norm over them sees one rank's shard only
        for name, sources in fed_by.items():
            if not sources & opened or name in projections or _within(closer, name):
                continue
            own = [p for p in block.get_submodule(name).parameters(recurse=False)]
            if any(p.dim() >= 1 and p.shape[-1] in widths for p in own):
                problems.append(
                    f"{name!r} ({type(block.get_submodule(name)).__name__}) computes over all the features of"
                    f" {openers} before {closer!r}, and after a column-wise split each rank holds only its share"
                )
        owner = _parent(closer)
        if all(_parent(o) == owner for o in openers):
            continue  # closed in the module that opens it
        homes = {_parent(o) for o in openers}
        if any(_parent(home) != _parent(owner) or home == owner for home in homes):
            problems.append(
                f"{closer!r} closes the split of {openers}, which are neither in its module nor in a sibling module"
            )
            continue
        for module, func, sources in reads:
            if not sources & opened:
                continue
            if any(_within(module, home) for home in homes if home) or _within(module, closer):
                continue  # the opening module's own computation, or the row-wise projection itself
            in_owner = module != owner and _within(module, owner)
            if in_owner and not any(True for _ in block.get_submodule(module).parameters()):
                continue  # a parameter-free module (dropout) of the closing module, applied elementwise
            if module == owner and func in _PASS_THROUGH:
                continue
            where = f"{module!r}" if module else f"the block {block_name!r}"
            problems.append(
                f"{where} applies {func!r} to the sharded output of {openers} before {closer!r} takes it (only the"
                " row-wise projection may read it when the split closes in a sibling module)"
            )
            break
    if block_output and (leaked := sorted(block_output[0] & {o for ops in regions.values() for o in ops})):
        problems.append(f"the block's output is computed from the sharded output of {leaked} past its row-wise split")
    if problems:
        raise HybridConfigError(
            f"`tensor_parallel_plan='auto'` found splits in {block_name!r} that would not train like one device:"
            f" {'; '.join(problems)}. Leave those layers replicated: give `tensor_parallel_plan` as a dict naming only"
            " the layers whose split closes exactly, or use data or pipeline parallel."
        )


def _decide(
    block_name: str,
    projections: dict[str, nn.Module],
    inputs: dict[str, frozenset[str]],
    first_use: dict[str, tuple[str, Any]],
) -> dict[str, str]:
    plan: dict[str, str] = {}
    problems: list[str] = []
    closers = {name: sources - {name} for name, sources in inputs.items() if sources - {name}}
    openers: dict[str, str] = {}
    for closer, sources in closers.items():
        for source in sorted(sources):
            if source in closers:
                problems.append(f"{source!r} both feeds {closer!r} and is fed by {sorted(closers[source])}")
            elif source in openers and openers[source] != closer:
                problems.append(f"{source!r} feeds both {openers[source]!r} and {closer!r}")
            openers[source] = closer
    for closer in closers:
        plan[closer] = "rowwise"
    for opener in sorted(openers, key=list(projections).index):
        use = first_use.get(opener, ("other", None))
        if use[0] == "split":
            sizes = use[1]
            if len(set(sizes)) == 1:
                plan[opener] = f"fused_colwise_{len(sizes)}"
            else:
                problems.append(
                    f"{opener!r} is a fused projection split into unequal parts {sizes} (e.g. q|k|v under grouped-"
                    "query attention): no tensor-parallel layout splits each part exactly"
                )
        elif use[0] == "slice":
            problems.append(f"{opener!r}'s output is sliced in the forward: give its style ('colwise_gather_output'?)")
        else:
            plan[opener] = "colwise"
    if problems:
        found = {f"{block_name}.{k}": v for k, v in plan.items()}
        raise HybridConfigError(
            "`tensor_parallel_plan='auto'` could not decide the plan of "
            f"{block_name!r} from its data flow: {'; '.join(problems)}. Found so far: {found}. Give"
            " `tensor_parallel_plan` as a dict completing it with the layers named above (fnmatch patterns, '*' for"
            " the layer index), or leave those layers out to keep them replicated."
        )
    return {k: plan[k] for k in projections if k in plan}
