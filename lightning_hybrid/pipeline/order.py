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
   pipeline/checks.py.

A module the forward calls on both sides of the blocks (or between them) is given to no stage: every stage keeps it,
as it keeps a bare ``nn.Parameter``, and their gradients are summed (pipeline/shared.py). :func:`io_slots` turns the
order into the input and output modules of the cut; :func:`check_one_block_list` refuses a second block list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_hybrid.config import HybridConfigError

__all__ = [
    "AFTER",
    "BEFORE",
    "BOTH",
    "call_order",
    "check_one_block_list",
    "declared_order",
    "io_slots",
    "observed_order",
]

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


@dataclass
class _Slot:
    parent: nn.Module
    attr: str
    module: nn.Module


def io_slots(
    network: nn.Module, blocks_rel: str, order: Optional[dict[str, str]] = None
) -> tuple[list[_Slot], list[_Slot]]:
    """Modules with parameters outside the blocks: inputs (the first stage holds them) and outputs (the last stage).

    ``order`` (pipeline/order.py: the side of the block list on which the forward calls each module, observed or
    declared) decides: a module called before the blocks is an input, one called after them an output, one called
    on both sides or between blocks is no slot (every stage keeps it, and its gradients are summed like a bare
    parameter's). Where ``order`` does not know a module, registration order stands in for call order: a module
    registered before the block list is an input, one registered after it an output; the vocabulary head is an output
    wherever it is registered (it maps the blocks' hidden state onto the token embedding's vocabulary; litgpt's
    ``GPT`` registers ``lm_head`` first). A module whose call order differs from that is caught by the checks of
    the first step (pipeline/checks.py), which refuse the cut instead of training it wrong."""
    from lightning_hybrid.structure import embedding_and_head

    outside = [(n, m) for n, m in network.named_modules() if n != blocks_rel and not n.startswith(blocks_rel + ".")]
    found = embedding_and_head(outside)[1]
    head = found[0] if found is not None else None
    inputs: list[_Slot] = []
    outputs: list[_Slot] = []
    taken: list[str] = []
    seen_blocks = False
    for name, module in network.named_modules():
        if name == blocks_rel:
            seen_blocks = True
            continue
        if not name or name.startswith(blocks_rel + ".") or blocks_rel.startswith(name + "."):
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        # a parent already taken as a slot (or kept on every stage) covers this module
        if any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        parent_name, _, attr = name.rpartition(".")
        parent = network.get_submodule(parent_name) if parent_name else network
        side = _side(order, name) if order else None
        if side is None:
            side = AFTER if seen_blocks or name == head else BEFORE
        if side == BEFORE:
            inputs.append(_Slot(parent, attr, module))
        elif side == AFTER:
            outputs.append(_Slot(parent, attr, module))
    return inputs, outputs


def _side(order: dict[str, str], name: str) -> Optional[str]:
    """The side of the block list on which ``name`` or the modules inside it are called (BOTH where they differ), or
    None where ``order`` knows none of them."""
    sides = {side for n, side in order.items() if n == name or n.startswith(name + ".")}
    if not sides:
        return None
    return sides.pop() if len(sides) == 1 else BOTH


def call_order(network: nn.Module, blocks_rel: str, root: Optional[nn.Module] = None) -> dict[str, str]:
    """The side of the block list on which the forward calls the modules outside it (pipeline/order.py): observed in
    a meta forward of ``root``'s ``example_input_array`` where it has one, else declared by a Hugging Face pipeline
    plan; empty where neither tells (registration order then stands in).

    Example:
        >>> # call_order(opt_for_causal_lm, "model.decoder.layers", lightning_module)["model.decoder.final_layer_norm"]
        >>> # 'after'
    """
    return _call_order(network, blocks_rel, root)[0]


def _call_order(network: nn.Module, blocks_rel: str, root: Optional[nn.Module]) -> tuple[dict[str, str], str]:
    """:func:`call_order`, and how the modules it does not know are placed, for the errors of the first step."""
    declared = declared_order(network, blocks_rel)
    order = dict(declared or {})
    example = getattr(root, "example_input_array", None) if root is not None else None
    observed = observed_order(root, network, blocks_rel, example) if root is not None else None
    if observed:
        # what was seen to run overrides what was declared about the same modules
        order = {k: v for k, v in order.items() if not any(n == k or n.startswith(k + ".") for n in observed)}
        order.update(observed)
        return order, "modules the forward did not call on `example_input_array` are placed by registration order"
    if example is not None:
        why = "the forward on `example_input_array` could not run on meta tensors (it reads values)"
    else:
        why = "the LightningModule has no `example_input_array` to show the forward's call order"
    if declared:
        return order, f"{why}; modules its Hugging Face pipeline plan (`_pp_plan`) does not name are placed by" + (
            " registration order"
        )
    return order, f"{why}, so modules are placed by registration order"


def check_one_block_list(network: nn.Module, blocks_rel: str) -> None:
    """Refuse a network with another block list beside the one the pipeline cuts (an encoder-decoder's encoder and
    decoder): the stages would cut only one, and the other's output, read by every block of the cut one, would be a
    zero stand-in on the stages that do not hold it."""
    from lightning_hybrid.structure import other_block_lists

    others = other_block_lists(network, blocks_rel)
    if others:
        name = type(network).__name__
        lists = ", ".join(f"`{n}`" for n in [*others, blocks_rel])
        raise HybridConfigError(
            f"`pipeline_parallel_size` > 1: {name} has several block lists ({lists}), as an encoder-decoder has;"
            f" the pipeline cuts one block list (`{blocks_rel}`) and cannot run the others in sequence with it."
            " Train this model without pipeline parallel (`pipeline_parallel_size=1`); tensor parallel, data"
            " parallel and ZeRO need no cut."
        )
