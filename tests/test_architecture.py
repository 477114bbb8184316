"""The package's layering, read from its source (no process is launched): the layers of ``LAYERS`` with no upward
import and no Lightning in the mechanisms, no import cycle, no module over 600 lines, and private torch names only in
``lightning_hybrid/_torch_compat.py``."""

from __future__ import annotations

import ast
import fnmatch
import functools
from pathlib import Path
from typing import Any, Optional

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hybrid"
COMPAT = {"_torch_compat.py"}
# moved into the compat module by the pipeline's own rework, on its branch: drop these once it is merged
NOT_YET_MOVED: set[str] = set()
# private attributes of torch objects the package has read (a name alone does not say which object it is read on)
TORCH_PRIVATE_ATTRIBUTES = {
    "_local_tensor", "_version", "_execution_engine", "_opname", "_modules", "_parameters", "_buffers",
    "_forward_pre_hooks", "_forward_hooks", "_partition_linear_fn", "_prepare_input_fn", "_opt_called",
    "_wrapped_by_lr_sched", "_timeout", "_Options", "_C",
}  # fmt: skip


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, f: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file: at module level, inside a function, and under
    ``if TYPE_CHECKING:`` (a type annotation's import runs no code, but it is a dependency all the same: the module
    cannot be read, or moved, without the one it names)."""
    return {target for target, _ in _import_statements(name, f, modules)}


def _import_statements(name: str, f: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(package module, line) of every import of another package module in ``f``."""
    found = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and (t, node.lineno) not in found:
                found.append((t, node.lineno))
    return found


def _external_imports(f: Path, roots: tuple[str, ...]) -> list[str]:
    """Imports of the libraries ``roots`` anywhere in ``f`` (module level, functions, ``TYPE_CHECKING``)."""
    found = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in roots]
    return found


def test_no_import_cycle_inside_the_package() -> None:
    """No cycle, counting imports under ``TYPE_CHECKING`` and inside functions: such an import hides a cycle from the
    interpreter, not from the reader."""
    modules = _modules()
    graph = {m: _imports(m, f, modules) for m, f in modules.items()}
    cycles = []
    for start in graph:  # a cycle through `start`: a path from one of its imports back to it
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(cycles))


# The package's layers, bottom to top, as module-name patterns (fnmatch; the most specific pattern that matches a
# module names its layer, so one module can sit above the rest of its package). A module imports from its own layer
# or a lower one only: at module level, inside a function and under `TYPE_CHECKING` alike. The package roots
# (`lightning_hybrid.checkpoint`, ...) re-export their modules, so each sits with the highest module it re-exports.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # what everything may use: errors and the layout as data, DTensor helpers, forward hooks, errors every rank
    # raises together, the compat modules (every private torch and Lightning name), transfers in flight and groups
    ("leaves", (
        "lightning_hybrid._version", "lightning_hybrid.config", "lightning_hybrid.layout",
        "lightning_hybrid.pipeline_schedules", "lightning_hybrid.dtensor", "lightning_hybrid._hooks",
        "lightning_hybrid.agreement",
        "lightning_hybrid._torch_compat", "lightning_hybrid._lightning_compat", "lightning_hybrid.transfers",
        "lightning_hybrid.process_groups",
    )),
    # the parallel mechanisms, written against torch alone (no Lightning: see MECHANISMS_IMPORT_NO_LIGHTNING)
    ("mechanisms", (
        "lightning_hybrid.structure", "lightning_hybrid.tensor_parallel*", "lightning_hybrid.pipeline",
        "lightning_hybrid.pipeline.*", "lightning_hybrid.sharding*", "lightning_hybrid.activation_checkpointing",
        "lightning_hybrid.compile", "lightning_hybrid.construction*", "lightning_hybrid.watchdog",
        "lightning_hybrid.expert_parallel*",
        "lightning_hybrid.context_parallel*",
        "lightning_hybrid.planning*", "lightning_hybrid.checkpoint.tensors", "lightning_hybrid.checkpoint.format",
        "lightning_hybrid.checkpoint.integrity", "lightning_hybrid.checkpoint.optimizer",
        "lightning_hybrid.checkpoint.consolidate", "lightning_hybrid.monitoring.comm",
        "lightning_hybrid.monitoring.metrics", "lightning_hybrid.unseen_run",
    )),
    # the mechanisms meeting Lightning: its precision plugin, callbacks and loggers, checkpoint files and hooks, its
    # cluster environment and data loaders, its LayerSync plugin
    ("lightning adapters", (
        "lightning_hybrid.precision*", "lightning_hybrid.monitoring*", "lightning_hybrid.checkpoint*",
        "lightning_hybrid.topology", "lightning_hybrid.data", "lightning_hybrid.batch_norm",
    )),
    # the model made parallel, and the step: what the strategy composes
    ("parallelize and the step spine", (
        "lightning_hybrid.parallelize", "lightning_hybrid.model_setup", "lightning_hybrid.module_step",
        "lightning_hybrid.sharding.gradient_step", "lightning_hybrid.optimizer_step",
    )),
    ("strategy and CLI", (
        "lightning_hybrid", "lightning_hybrid.options", "lightning_hybrid.strategy", "lightning_hybrid.cli",
        "lightning_hybrid.__main__",
    )),
]  # fmt: skip
MECHANISMS_IMPORT_NO_LIGHTNING = ("lightning", "pytorch_lightning", "lightning_hybrid._lightning_compat")
"""What a mechanism may not import. ``lightning_utilities`` is allowed: a standalone package of generic helpers
(``apply_to_collection``; ``rank_zero_info``, the very function Lightning re-exports), with no Trainer, module or
plugin in it."""
UPWARD_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {}
"""(importer, imported) pairs that still go upward, each with why; checked to be still needed, so it only shrinks."""


def _specificity(pattern: str) -> tuple[int, int]:
    return (0 if "*" in pattern else 1, len(pattern.replace("*", "")))


def _layer_of(module: str) -> Optional[int]:
    matches = [
        (_specificity(pattern), index)
        for index, (_, patterns) in enumerate(LAYERS)
        for pattern in patterns
        if fnmatch.fnmatchcase(module, pattern)
    ]
    return max(matches)[1] if matches else None


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in _modules() if _layer_of(m) is None)
    assert not unplaced, f"place these modules in a layer of LAYERS: {unplaced}"


def test_no_module_imports_from_a_higher_layer() -> None:
    modules = _modules()
    upward, used = [], set()
    for name, f in sorted(modules.items()):
        for target, line in _import_statements(name, f, modules):
            own, theirs = _layer_of(name), _layer_of(target)
            if own is None or theirs is None or theirs <= own:
                continue
            if (name, target) in UPWARD_IMPORTS_ALLOWED:
                used.add((name, target))
                continue
            upward.append(f"{name}:{line} ({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not upward, "\n".join(upward)
    stale = sorted(set(UPWARD_IMPORTS_ALLOWED) - used)
    assert not stale, f"no longer needed, remove from UPWARD_IMPORTS_ALLOWED: {stale}"


def test_mechanisms_import_no_lightning() -> None:
    mechanisms = next(index for index, (layer, _) in enumerate(LAYERS) if layer == "mechanisms")
    modules = _modules()
    found = {
        name: uses
        for name, f in sorted(modules.items())
        if _layer_of(name) == mechanisms
        and (uses := _external_imports(f, ("lightning", "pytorch_lightning")) + _compat_imports(name, f, modules))
    }
    assert not found, "\n".join(f"{name}:{use}" for name, uses in found.items() for use in uses)


def _compat_imports(name: str, f: Path, modules: dict[str, Path]) -> list[str]:
    return [
        f"{line}: {target}"
        for target, line in _import_statements(name, f, modules)
        if target in MECHANISMS_IMPORT_NO_LIGHTNING
    ]


def test_no_module_is_over_600_lines() -> None:
    """A module longer than this holds more than one thing: split it by what it owns."""
    long = {name: n for name, f in _modules().items() if (n := len(f.read_text().splitlines())) > 600}
    assert not long, long


def _private_uses(f: Path, roots: tuple[str, ...], attributes: set[str], attribute_roots: tuple[str, ...]) -> list[str]:
    """Private names of the libraries ``roots`` that ``f`` imports, and the private ``attributes`` it reads (on
    anything but ``self``), and any private attribute reached from a name in ``attribute_roots`` (``torch._C``)."""
    uses = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in roots:
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                uses.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and node.attr in attributes:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in attribute_roots:
                uses.append(f"{node.lineno}: {ast.unparse(node)}")
    return uses


def _uses_outside(compat: set[str], *args: Any) -> str:
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel not in compat and (uses := _private_uses(f, *args)):
            found[rel] = uses
    return "\n".join(f"{rel}:{use}" for rel, uses in found.items() for use in uses)


def test_private_torch_names_only_in_the_compat_module() -> None:
    found = _uses_outside(COMPAT | NOT_YET_MOVED, ("torch",), TORCH_PRIVATE_ATTRIBUTES, ("torch", "dist"))
    assert not found, found


# private attributes of Lightning objects the package has read (LightningModule, LightningOptimizer, Strategy)
LIGHTNING_PRIVATE_ATTRIBUTES = {"_trainer", "_optimizer", "_device_mesh", "_layer_sync", "_precision_plugin"}
LIGHTNING = ("lightning", "lightning_utilities", "pytorch_lightning")


def test_private_lightning_names_only_in_the_compat_module() -> None:
    found = _uses_outside({"_lightning_compat.py"}, LIGHTNING, LIGHTNING_PRIVATE_ATTRIBUTES, LIGHTNING)
    assert not found, found
