"""Every private torch API the package touches, in one place.

Each entry says which torch versions it was checked on and the public replacement to switch to once one exists.
No other module of the package imports a private torch name.
"""

from __future__ import annotations

from torch import nn

__all__ = ["module_children", "module_parameters"]


def module_children(module: nn.Module) -> dict[str, nn.Module]:
    """``Module._modules``: the live table of a module's children, written to swap a child for the length of one
    pipeline stage's forward (``setattr`` checks parameters, buffers and submodules on every call; a stage swaps
    modules per micro-batch). Checked on torch 2.11 and 2.13. Public replacement: ``register_module`` /
    ``setattr`` (correct, slower); none gives the table itself."""
    return module._modules  # type: ignore[return-value]


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``Module._parameters``: the parameters registered on ``module`` itself, read live (FSDP2 swaps sharded and
    unsharded tensors in) without walking the tree. Checked on torch 2.11 and 2.13. Public replacement:
    ``module.named_parameters(recurse=False)`` (a generator per call, slower per step)."""
    return module._parameters  # type: ignore[return-value]
