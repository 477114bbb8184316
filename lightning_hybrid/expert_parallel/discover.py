"""Finding a model's experts modules by structure, as the tensor-parallel plan finds its layers.

An experts module that expert parallel can dispatch is the form transformers 5 gives every MoE family it ships
(Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS, ...) and torchtitan's grouped experts: the experts' weights
packed in tensors whose first dimension is the expert, and a forward that takes the tokens, each token's chosen
experts and their routing weights: ``experts(hidden_states, top_k_index, top_k_weights)``. The router, top-k, the
normalisation of the weights and the load-balancing loss stay in the model's own code, outside that call.

A block whose routing loop is its own code (a list of expert modules it calls in turn, or a forward that takes
something other than indices and weights) cannot be dispatched without rewriting the model: it is named, not
guessed at.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["EXPERT_COUNT_ATTRIBUTES", "ExpertModule", "find_expert_modules"]

# the attributes in which MoE families record their expert count (read by their own forward, e.g. for a one-hot)
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ExpertModule:
    """An experts module expert parallel can dispatch: its name in the model and its number of experts."""

    name: str
    num_experts: int


def _takes_routing(module: nn.Module) -> bool:
    """Whether the forward's first three parameters are (tokens, expert indices, routing weights)."""
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    if len(names) < 3:
        return False
    index, weights = names[1].lower(), names[2].lower()
    return any(w in index for w in ("index", "indices", "selected")) and "weight" in weights


def _looks_like_experts(module: nn.Module, name: str) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return "expert" in type(module).__name__.lower() or (isinstance(module, nn.ModuleList) and "expert" in leaf)


def _stacked_rows(module: nn.Module) -> str:
    """The reason for DBRX's form, where it is one: every expert's rows stacked in the first dimension of 2-D
    matrices inside a child module (``mlp.w1``: experts x ffn rows, hidden columns), which the module's own loop views
    per expert; else ``""``."""
    count = next((v for a in EXPERT_COUNT_ATTRIBUTES if isinstance(v := getattr(module, a, None), int)), 0)
    stacked = [
        n for n, p in module.named_parameters() if "." in n and p.dim() == 2 and count > 1 and p.shape[0] % count == 0
    ]
    if not stacked:
        return ""
    return (
        f"its expert weights ({', '.join(stacked[:3])}) are 2-D matrices stacking every expert's rows in a child module"
        " (DBRX's form), not tensors whose first dimension is the expert"
    )


def find_expert_modules(module: nn.Module) -> tuple[list[ExpertModule], dict[str, str]]:
    """The experts modules of ``module`` that can be dispatched, and those that look like experts but cannot (name:
    why).

    Example:
        >>> import torch
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.up = nn.Parameter(torch.zeros(4, 8, 2))
        ...     def forward(self, hidden_states, top_k_index, top_k_weights):
        ...         return hidden_states
        >>> find_expert_modules(nn.Sequential(Experts()))
        ([ExpertModule(name='0', num_experts=4)], {})
    """
    found: list[ExpertModule] = []
    doubtful: dict[str, str] = {}
    for name, sub in module.named_modules():
        own = [p for _, p in sub.named_parameters(recurse=False)]
        packed = [p for p in own if p.dim() >= 3]
        leading = {p.shape[0] for p in own if p.dim() >= 2}
        if packed and len(leading) == 1 and _takes_routing(sub):
            found.append(ExpertModule(name, next(iter(leading))))
        elif _looks_like_experts(sub, name) and not any(name.startswith(d + ".") for d in doubtful):
            if isinstance(sub, nn.ModuleList):
                why = (
                    "a list of expert modules that the block around it calls in its own loop: the routing is the"
                    " block's code, so tokens cannot be sent to experts on other ranks"
                )
            elif not packed:
                why = _stacked_rows(sub) or (
                    "it holds no packed expert weights (a tensor whose first dimension is the expert)"
                )
            elif len(leading) != 1:
                why = f"its weights do not share one expert dimension (leading sizes {sorted(leading)})"
            else:
                why = (
                    f"its forward takes {str(inspect.signature(type(sub).forward))!r}, not (hidden_states,"
                    " top_k_index, top_k_weights)"
                )
            doubtful[name] = why
    # a module inside or around a dispatchable experts module is that module's own business
    names = [e.name for e in found]
    refused = {
        n: why
        for n, why in doubtful.items()
        if not any(n.startswith(f + ".") or f.startswith(n + ".") or n == f for f in names)
    }
    return found, refused
