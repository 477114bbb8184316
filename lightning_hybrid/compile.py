"""``compile=True``: ``torch.compile`` per transformer block (regional compilation, as torchtitan does).

Each block this rank holds is compiled in place with :meth:`torch.nn.Module.compile` after tensor parallel and
activation checkpointing and before ZeRO-3 wraps it: the block keeps its class, parameter names and state-dict keys
(no ``_orig_mod.`` prefix), so checkpoints, resharding and the tensor-parallel plan see the same model as without
compile. Dynamo traces ``nn.Module`` calls with the module's parameters as graph inputs (inline_inbuilt_nn_modules:
the default from torch 2.5, always on from 2.13), so every block of the same class and input shape reuses one
compiled graph: a 32-block model compiles once, not 32 times.
"""

from __future__ import annotations

from torch import nn

__all__ = ["COMPILE_NEEDS_BLOCKS", "compile_blocks", "compile_needs_blocks"]

COMPILE_NEEDS_BLOCKS = "`compile=True` (each transformer block is compiled on its own, once per block type)"


def compile_needs_blocks(enabled: bool) -> list[str]:
    """The reason ``compile`` needs the block list, for :func:`~lightning_hybrid.structure.find_model_structure`'s
    ``needed_by`` (empty when compile is off): a model without one is refused with the fix before training.

    Example:
        >>> compile_needs_blocks(False)
        []
    """
    return [COMPILE_NEEDS_BLOCKS] if enabled else []


def compile_blocks(root: nn.Module, block_names: list[str]) -> None:
    """Compile each named block in place (``block.compile()``: inductor, ``fullgraph=False``, so a block with a graph
    break still runs, partly eagerly). Compilation itself happens at the first forward of each block type.

    Under pipeline parallel pass only the blocks this rank holds: the stand-ins for other ranks' blocks run nothing.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> compile_blocks(net, ["0", "1"])
        >>> list(net.state_dict())  # names unchanged
        ['0.weight', '0.bias', '1.weight', '1.bias']
    """
    for name in block_names:
        root.get_submodule(name).compile()
