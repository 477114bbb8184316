"""What the package replaces at run time, read from its source: every place that writes over a torch, Lightning or
transformers attribute, a class, or a method of an object it did not make, must be one listed, with its reason, in
docs/architecture.md ("What the package replaces at run time"); and every listed one must still be in the source.
A new patch site fails here until it is listed (or written another way: a module hook, a wrapper object, an
argument), and a removed one until its row goes. No process is launched; the check that nothing of torch is
replaced during a fit is tests/test_monitoring.py::test_nothing_of_torch_is_replaced_during_a_fit.

What counts as a patch site (``Scan``):

- any write to ``__class__``;
- a write to an attribute of an imported torch / Lightning / transformers name (``torch.nn.init.x = ...``,
  ``setattr(dist, name, ...)``, ``rank_zero_only.rank = ...``);
- a write to an attribute named like a method of ``nn.Module``, ``Optimizer``, ``LightningModule``, ``Callback``,
  ``Strategy`` or ``Precision`` (``forward``, ``step``, ``log``, ...) on anything but ``self``;
- a write of a function made on the spot (a nested ``def``, a ``lambda``, ``MethodType(...)``, ``partial(...)``) to
  an attribute of anything but ``self``: an instance method replaced;
- the same through ``obj.__dict__[key] = ...``, ``setattr(obj, key, ...)`` and the package's own
  ``attribute_replaced(obj, key, ...)`` / ``forward_replaced(obj, ...)`` helpers (on anything but ``self``).

A site is named by (module, enclosing function, attribute); ``*`` for an attribute whose name is not written out.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_hybrid"
REGISTRY = ROOT / "docs" / "architecture.md"
HEADING = "## What the package replaces at run time"
LIBRARIES = {"torch", "lightning", "lightning_utilities", "pytorch_lightning", "transformers"}
FUNCTION_MAKERS = {"MethodType", "partial", "wraps"}

Site = tuple[str, str, str]  # (module path, enclosing function, attribute)


@functools.cache
def _method_names() -> frozenset[str]:
    classes = (nn.Module, torch.optim.Optimizer, pl.LightningModule, pl.Callback, pl.strategies.Strategy,
               pl.plugins.precision.Precision)  # fmt: skip
    names = {n for cls in classes for n in dir(cls) if not n.startswith("__") and callable(getattr(cls, n, None))}
    return frozenset(names | {"forward", "__call__", "__class__"})


@functools.cache
def _string_constants() -> dict[str, str]:
    """Module-level ``NAME = "text"`` constants of the package (an attribute named through one is resolved)."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        for node in ast.parse(f.read_text()).body:
            constant = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            if constant and isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


@functools.cache
def _own_attributes() -> frozenset[str]:
    """Attributes the package's own classes define (``self.name = ...``, or annotated in the class body): a callable
    written to one of them configures the package's own object (a runner's ``explain_step_failure``)."""
    out = set()
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
            if isinstance(node, ast.ClassDef):
                out |= {b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and hasattr(b.target, "id")}
    return frozenset(out - _method_names())


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _root(node: ast.AST) -> Optional[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


class Scan(ast.NodeVisitor):
    """The patch sites of one module (see the module docstring)."""

    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path, self.stack, self.found = path, [], set()
        self.libraries = set()  # names bound to imported library modules or objects
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.libraries |= {a.asname or a.name.split(".")[0] for a in node.names if _library(a.name)}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _library(node.module or ""):
                self.libraries |= {a.asname or a.name for a in node.names}
        self.local_functions: set[str] = set()
        self.visit(tree)

    def _note(self, attribute: str) -> None:
        self.found.add((self.path, ".".join(self.stack) or "<module>", attribute))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.stack:
            self.local_functions.add(node.name)
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def _made_here(self, value: Optional[ast.AST]) -> bool:
        """A function made on the spot: a lambda, a nested def, ``MethodType(...)``, ``partial(...)``."""
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in self.local_functions
        if isinstance(value, ast.Call):
            f = value.func
            return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in FUNCTION_MAKERS
        return False

    def _key(self, node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in _string_constants():
            return _string_constants()[node.id]
        return "*"

    def _written(self, owner: ast.AST, attribute: str, value: Optional[ast.AST]) -> None:
        if attribute == "__class__" or _root(owner) in self.libraries:
            self._note(attribute)
        elif _is_self(owner):
            return  # the object's own attribute
        elif attribute in _method_names():
            self._note(attribute)
        elif self._made_here(value) and attribute not in _own_attributes():
            self._note(attribute)

    def _target(self, target: ast.AST, value: Optional[ast.AST]) -> None:
        if isinstance(target, ast.Attribute):
            self._written(target.value, target.attr, value)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
            if target.value.attr == "__dict__":
                self._written(target.value.value, self._key(target.slice), value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._target(element, None)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name == "setattr" and len(node.args) == 3:
            self._written(node.args[0], self._key(node.args[1]), node.args[2])
        elif name == "attribute_replaced" and len(node.args) >= 2 and not _is_self(node.args[0]):
            self._note(self._key(node.args[1]))
        elif name == "forward_replaced" and node.args and not _is_self(node.args[0]):
            self._note("forward")
        self.generic_visit(node)


def _library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def patch_sites() -> set[Site]:
    found: set[Site] = set()
    for f in sorted(PACKAGE.rglob("*.py")):
        found |= Scan(f.relative_to(ROOT).as_posix(), ast.parse(f.read_text())).found
    return found


def registry() -> dict[Site, str]:
    """The listed sites: each table row under the heading, ``| `module` | `function` | `attribute` | ... |``."""
    text = REGISTRY.read_text()
    assert HEADING in text, f"{REGISTRY} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and all(re.fullmatch(r"`[^`]+`", c) for c in cells[:3]):
            site = tuple(c.strip("`") for c in cells[:3])
            rows[site] = cells[4]  # type: ignore[index]
    return rows  # type: ignore[return-value]


def test_every_patch_site_is_listed_with_its_reason() -> None:
    listed = registry()
    found = patch_sites()
    new = sorted(found - set(listed))
    rows = "\n".join(f"| `{m}` | `{f}` | `{a}` |" for m, f, a in new)
    assert not new, (
        f"patch sites not listed under {HEADING!r} in docs/architecture.md (list each with why, or write it with a"
        f" hook, a wrapper object or an argument instead):\n{rows}"
    )
    gone = sorted(set(listed) - found)
    assert not gone, f"listed but no longer in the source, remove their rows: {gone}"
    assert all(why for why in listed.values()), "every listed site says why"


def test_the_scan_sees_each_kind_of_patch() -> None:
    """The scan on examples of each kind, and on what is not a patch."""
    source = '''
import torch.distributed as dist
from types import MethodType
from lightning.pytorch.utilities import rank_zero_only

def patches(module, optimizer, name):
    dist.all_reduce = None
    rank_zero_only.rank = 0
    optimizer.__class__ = type("X", (type(optimizer),), {})
    module.forward = None
    module.step = MethodType(print, module)
    def inner():
        pass
    module.helper = inner
    module.__dict__["forward"] = None
    setattr(module, "log", None)
    setattr(dist, name, None)
    attribute_replaced(module, "log_dict", None)
    forward_replaced(module, None)

class Own:
    def fine(self, module):
        self.forward = None
        self.step = lambda: None
        module.config = object()
        module.num_heads = 2
        setattr(module, name, 3)
        attribute_replaced(self, "x", 1)
'''
    found = {(f, a) for _, f, a in Scan("example.py", ast.parse(source)).found}
    assert found == {
        ("patches", "all_reduce"), ("patches", "rank"), ("patches", "__class__"), ("patches", "forward"),
        ("patches", "step"), ("patches", "helper"), ("patches", "log"), ("patches", "*"), ("patches", "log_dict"),
    }, found  # fmt: skip
