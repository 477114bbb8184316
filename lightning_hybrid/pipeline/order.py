"""Which side of the block list the network's forward calls each module on, found before the network is cut.

The cut (pipeline/stage.py) gives the first stage the modules called before the block list (embeddings) and the last
stage those called after it (final norm, head). Registration order is not call order: OPT's decoder registers its
``final_layer_norm`` before its ``layers`` and calls it after them. The order is found, best source first:

1. **observed**: the LightningModule's ``forward`` runs once on its ``example_input_array`` with every parameter and
   buffer swapped for a meta tensor (``torch.func.functional_call``: no memory, no compute, no side effects on the
   real tensors), and forward pre-hooks record whether each module outside the blocks was called before the first
   block, after the last, or in between;
2. **declared**: a Hugging Face model's pipeline plan (``config.base_model_pp_plan``, the model's ``_pp_plan``), whose
   keys list the base model's modules in forward order around the block list, and whose head class entries
   (``lm_head``) run after the base model;
3. **registered**: ``named_modules()`` order (the caller's fallback), checked at the first step by
   pipeline/verify.py.

A module the forward calls on both sides of the blocks (or between them) is given to no stage: every stage keeps it,
as it keeps a bare ``nn.Parameter``, and their gradients are summed (pipeline/shared.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

__all__ = ["BEFORE", "AFTER", "BOTH", "declared_order", "observed_order"]

BEFORE, AFTER, BOTH = "before", "after", "both"
Order = dict[str, str]
"""Module name (relative to the network) -> BEFORE, AFTER or BOTH."""


def _outside(name: str, blocks_rel: str) -> bool:
    return bool(name) and name != blocks_rel and not name.startswith(blocks_rel + ".")


def observed_order(root: nn.Module, network: nn.Module, blocks_rel: str, example: Any) -> Optional[Order]:
    """The side of the block list on which ``root(example)`` calls each module of ``network`` outside the blocks,
    from a forward on meta tensors; None when there is no example, the forward fails on meta (it reads values:
    ``.item()``) or it never reaches the blocks. Modules it does not call are absent.

    Example:
        >>> # observed_order(lightning_module, lightning_module.model, "model.decoder.layers", example_input)
        >>> # {'model.decoder.embed_tokens': 'before', 'model.decoder.final_layer_norm': 'after', 'lm_head': 'after'}
    """
    if example is None:
        return None
    blocks = network.get_submodule(blocks_rel)
    if len(blocks) == 0:
        return None
    first, last = blocks[0], blocks[len(blocks) - 1]
    state = {"entered": False, "left": False}
    seen: dict[str, set[str]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            side = AFTER if state["left"] else BOTH if state["entered"] else BEFORE
            seen.setdefault(name, set()).add(side)

        return hook

    def enter(module: nn.Module, args: Any) -> None:
        state["entered"] = True
        state["left"] = False  # a block list run twice: what follows its last block's first run was in between

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        state["left"] = True

    handles = [first.register_forward_pre_hook(enter, prepend=True), last.register_forward_hook(leave)]
    handles += [m.register_forward_pre_hook(record(n)) for n, m in network.named_modules() if _outside(n, blocks_rel)]
    try:
        # tied weights once (functional_call ties names of one tensor); the real tensors are untouched and put back
        meta = {n: torch.empty_like(t, device="meta") for n, t in [*root.named_parameters(), *root.named_buffers()]}
        with torch.no_grad():
            args, kwargs = _to_meta(example)
            torch.func.functional_call(root, meta, args, kwargs, strict=False)
    except Exception:  # a forward that reads values cannot run on meta tensors: no observation
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not state["entered"]:
        return None
    return {name: sides.pop() if len(sides) == 1 else BOTH for name, sides in seen.items()}


def _to_meta(example: Any) -> tuple[tuple, dict]:
    """``example_input_array`` as the arguments of ``forward``, as Lightning passes it (a tuple or list: the
    positional arguments; a dict: the keyword arguments; anything else: the only argument), every tensor on meta."""
    from lightning_utilities.core.apply_func import apply_to_collection

    moved = apply_to_collection(example, torch.Tensor, lambda t: torch.empty_like(t, device="meta"))
    if isinstance(moved, (tuple, list)):
        return tuple(moved), {}
    if isinstance(moved, dict):
        return (), dict(moved)
    return (moved,), {}


def declared_order(network: nn.Module, blocks_rel: str) -> Optional[Order]:
    """The side of the block list of each module a Hugging Face pipeline plan names, or None without one.

    The plan of the module that holds the block list lists its modules in forward order (keys before the block list
    are called before it); entries an enclosing model adds (the head class's ``lm_head``) run after the base model.

    Example:
        >>> # declared_order(llama_for_causal_lm, "model.layers")
        >>> # {'model.embed_tokens': 'before', 'model.norm': 'after', 'lm_head': 'after'}
    """
    plans = []
    for name, module in network.named_modules():
        plan = getattr(module, "_pp_plan", None)
        if not isinstance(plan, dict) or not plan:
            config_plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
            plan = config_plan if isinstance(config_plan, dict) and config_plan else None
        if plan is None:
            continue
        keys = [f"{name}.{k}" if name else str(k) for k in plan]
        if blocks_rel in keys:
            plans.append((name, keys))
    if not plans:
        return None
    # the innermost plan (the base model's) orders the modules around the blocks; an outer plan's other entries are
    # its head's, called on the base model's output
    plans.sort(key=lambda p: -len(p[0]))
    order: Order = {}
    _, keys = plans[0]
    at = keys.index(blocks_rel)
    order.update({k: BEFORE for k in keys[:at]})
    order.update({k: AFTER for k in keys[at + 1 :]})
    for _, keys in plans[1:]:
        for k in keys:
            if k != blocks_rel and k not in order:
                order[k] = AFTER
    return {k: v for k, v in order.items() if _resolves(network, k)}


def _resolves(network: nn.Module, name: str) -> bool:
    try:
        network.get_submodule(name)
        return True
    except AttributeError:
        return False
