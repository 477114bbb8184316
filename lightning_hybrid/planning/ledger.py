"""Model-state memory per device: parameters, gradients, fp32 master weights and optimizer state, for every ZeRO
stage under tensor and pipeline parallel; and the ledger that adds activations and temporary buffers to them.

Two forms: :func:`state_bytes_per_parameter` (bytes per parameter a rank holds, for planning from sizes) and
:func:`predict_model_state_bytes` (per rank, parameter by parameter, from a module built on the meta device: what
``HybridStrategy.model_state_bytes`` measures, to the byte).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Optional

from torch import nn

from lightning_hybrid.config import HybridConfigError

__all__ = ["PRECISION_BYTES", "Ledger", "predict_model_state_bytes", "state_bytes_per_parameter"]

# precision -> (parameter, gradient, fp32 master, activation) bytes. Lightning's names are what HybridStrategy holds:
# '-mixed' keeps fp32 parameters and gradients (autocast casts on the fly); '-true' keeps 2-byte parameters, fp32
# master weights in the optimizer and accumulates gradients in fp32 (Megatron's main_grad). "bf16"/"fp16" is the
# mixed precision of the ZeRO paper and of the seeds' arithmetic: 2-byte parameters and gradients, fp32 master.
PRECISION_BYTES: dict[str, tuple[int, int, int, int]] = {
    "32-true": (4, 4, 0, 4),
    "32": (4, 4, 0, 4),
    "bf16-mixed": (4, 4, 0, 2),
    "16-mixed": (4, 4, 0, 2),
    "bf16-true": (2, 4, 4, 2),
    "16-true": (2, 4, 4, 2),
    "bf16": (2, 2, 4, 2),
    "fp16": (2, 2, 4, 2),
}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1, "sgd-momentum": 1, "sgd-nomomentum": 0}
_STRATEGY_PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _check(precision: str, optimizer: str) -> None:
    if precision not in PRECISION_BYTES:
        raise HybridConfigError(f"`precision={precision!r}` is not one of {sorted(PRECISION_BYTES)}.")
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise HybridConfigError(f"`optimizer={optimizer!r}` is not one of {sorted(OPTIMIZER_STATES)}.")


def state_bytes_per_parameter(
    precision: str, optimizer: str, zero_stage: int, data_parallel_size: int, *, expert_parallel_size: int = 1
) -> dict[str, float]:
    """Bytes per (tensor- and pipeline-local) parameter a rank holds, by kind.

    ZeRO-1 shards the master and the optimizer state over the data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3
    also the parameters. The strategy's ZeRO-3 steps fp32 shards directly, so under '-true' precisions those shards
    are the master weights (no separate copy).

    ``expert_parallel_size=ep`` gives the bytes per *expert* parameter a rank holds (it holds ``1/ep`` of the
    experts): ZeRO shards those over the ``dp / ep`` ranks holding the same experts, while whether there are masters
    at all is the stage's, decided by the whole data-parallel size (docs/expert-parallel.md).

    Example (the seeds' LLaMA-7B, Adam, bf16: 2 + 2 + 12 = 16 bytes per parameter):
        >>> state_bytes_per_parameter("bf16", "adam", 0, 1)
        {'parameters': 2, 'gradients': 2, 'master': 4, 'optimizer': 8}
        >>> sum(state_bytes_per_parameter("bf16", "adam", 3, 8).values())
        2.0
        >>> state_bytes_per_parameter("bf16-mixed", "adam", 1, 8, expert_parallel_size=4)  # over 2 ranks
        {'parameters': 4, 'gradients': 4, 'master': 2.0, 'optimizer': 4.0}
    """
    _check(precision, optimizer)
    p, g, m, _ = PRECISION_BYTES[precision]
    opt = 4 * OPTIMIZER_STATES[optimizer.lower()]
    if expert_parallel_size < 1 or data_parallel_size % expert_parallel_size:
        raise HybridConfigError(
            f"`expert_parallel_size={expert_parallel_size}` must divide the data-parallel size ({data_parallel_size})."
        )
    d = data_parallel_size // expert_parallel_size  # the ranks a (expert) parameter's state is sharded over
    if data_parallel_size == 1 and zero_stage in (1, 2) and precision in _STRATEGY_PRECISIONS:
        zero_stage = 0  # the strategy steps one replica as stage 0: nothing to shard, no fp32 copy
    if zero_stage == 3 and precision in _STRATEGY_PRECISIONS:
        return {"parameters": 4 / d, "gradients": 4 / d, "master": 0, "optimizer": opt / d}
    if zero_stage >= 1 and precision in _STRATEGY_PRECISIONS and m == 0:
        m = 4  # the strategy's ZeRO-1/2 step a flat fp32 copy of the rank's shard (as DeepSpeed does)
    return {
        "parameters": p / d if zero_stage >= 3 else p,
        "gradients": g / d if zero_stage >= 2 else g,
        "master": m / d if zero_stage >= 1 else m,
        "optimizer": opt / d if zero_stage >= 1 else opt,
    }


@dataclass(frozen=True)
class Ledger:
    """Bytes on the most loaded device of a layout."""

    parameters: float
    gradients: float
    master: float
    optimizer: float
    activations: float
    buffers: float
    setup: float = 0.0
    """Bytes at set-up, before the first step: the rank's parameter shards plus the one full tensor deferred
    construction's replay holds at a time (``construction/replay.py``), counted as the largest. A model built whole
    on every rank (in ``__init__``) needs its full size here instead; the planner assumes deferred construction."""

    @property
    def training(self) -> float:
        return self.parameters + self.gradients + self.master + self.optimizer + self.activations + self.buffers

    @property
    def peak(self) -> float:
        return max(self.training, self.setup)

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.master + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in asdict(self).items()}, "peak": float(self.peak)}


# ---------------------------------------------------------------------- exact, per parameter, from a (meta) module
def _chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` of ``n`` split into ``parts`` as ``torch.chunk`` (DTensor's Shard, FSDP2) does."""
    size = -(-n // parts)
    return max(0, min(n, (index + 1) * size) - index * size)


def _tensor_parallel_shape(shape: list[int], style: Any, module: nn.Module, leaf: str, t: int, r: int) -> list[int]:
    """The local shape of a parameter on tensor-parallel rank ``r`` under ``style`` (torch's styles and ours)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_hybrid._torch_compat import is_strided_shard
    from lightning_hybrid.tensor_parallel.plan import FusedColwiseParallel
    from lightning_hybrid.tensor_parallel.styles import LocalShardParallel

    shape = list(shape)
    if style is None or t == 1:
        return shape
    if isinstance(style, FusedColwiseParallel):  # each of k blocks of dim 0 split t ways
        k = style.num_blocks
        shape[0] = k * _chunk(shape[0] // k, t, r)
        return shape
    if isinstance(style, LocalShardParallel):  # a module's own parameters by name (packed MoE experts)
        placement = style.placements.get(leaf)
        dim = getattr(placement, "dim", None)
        if dim is not None:
            k = placement.split_factor if is_strided_shard(placement) else 1
            shape[dim] = k * _chunk(shape[dim] // k, t, r)
        return shape
    dim = None
    if isinstance(style, ColwiseParallel):
        dim = 1 if isinstance(module, nn.Embedding) else 0
    elif isinstance(style, RowwiseParallel):
        dim = 0 if isinstance(module, nn.Embedding) else (1 if leaf == "weight" else None)
    if dim is not None and dim < len(shape):
        shape[dim] = _chunk(shape[dim], t, r)
    return shape


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _optimizer_groups(module: nn.Module) -> list[list[nn.Parameter]]:
    """The parameter groups of ``configure_optimizers()`` (an optimizer, a list, or Lightning's dict forms)."""
    from torch.optim import Optimizer

    configured: Any = module.configure_optimizers() if hasattr(module, "configure_optimizers") else None
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        if isinstance(configured, (list, tuple)):
            configured = configured[0]
        if isinstance(configured, dict):
            configured = configured["optimizer"]
    if not isinstance(configured, Optimizer):
        return [[p for p in module.parameters()]]
    return [list(g["params"]) for g in configured.param_groups]


def predict_model_state_bytes(
    module: nn.Module,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    zero_stage: int = 1,
    precision: str = "32-true",
    tensor_parallel_plan: Any = "auto",
    vocab_parallel_loss: bool = True,
    transformer_blocks: Optional[str] = None,
    pipeline_partition: Any = "uniform",
    virtual_pipeline_size: int = 1,
    pipeline_schedule: str = "1f1b",
    overlap_grad_reduce: bool = True,
    expert_parallel_size: int = 1,
) -> list[dict[str, int]]:
    """What ``HybridStrategy.model_state_bytes`` will measure on each global rank, from the module alone.

    ``module`` is the LightningModule (built on the meta device, or any device: it is not changed). Parameters are
    split as the strategy splits them: the tensor-parallel plan it would build (each style's split dimension, with
    ``torch.chunk``'s uneven pieces), the pipeline stages it would cut (``split_network`` on a copy), the optimizer's
    parameter groups from ``configure_optimizers()`` flattened and padded to a multiple of the data-parallel size
    (ZeRO-1/2), or each parameter chunked over the data-parallel ranks (FSDP2, ZeRO-3). Tied weights across pipeline
    stages are not modelled.

    ``expert_parallel_size=ep``: each MoE layer's packed expert weights (the experts modules
    :func:`~lightning_hybrid.expert_parallel.find_expert_modules` finds) are split on their expert dimension over
    ``ep`` consecutive data-parallel ranks and kept whole on every tensor-parallel rank; their ZeRO-1/2 flat groups
    are sharded over the ``dp / ep`` ranks holding the same experts, and under ZeRO-3 FSDP2 chunks each rank's expert
    shard over those ranks. What the strategy refuses with expert parallel is refused here too.

    Example:
        >>> import torch
        >>> from examples.nanogpt import NanoGPT
        >>> with torch.device("meta"):
        ...     module = NanoGPT(n_layer=2, n_embd=32)
        >>> [r["total"] for r in predict_model_state_bytes(module, data_parallel_size=2, zero_stage=3)]
        [285696, 285696]
    """
    import torch

    from lightning_hybrid.pipeline.partition import partition_blocks
    from lightning_hybrid.pipeline.stage import split_network
    from lightning_hybrid.structure import find_model_structure
    from lightning_hybrid.tensor_parallel.plan import build_tensor_parallel_plan

    t, p, d, ep = tensor_parallel_size, pipeline_parallel_size, data_parallel_size, expert_parallel_size
    low = precision in ("bf16-true", "16-true")
    structure = find_model_structure(module, transformer_blocks)
    plan = build_tensor_parallel_plan(module, structure, tensor_parallel_plan, vocab_parallel_loss=vocab_parallel_loss)
    expert_names = _expert_names(module, ep, d)
    if expert_names:
        plan.without(expert_names)  # the experts go to expert ranks, whole on each tensor rank
    styles = plan.styles if t > 1 else {}
    by_rank: dict[int, dict[str, int]] = {}
    for pr in range(p):
        held = module
        if p > 1:
            held = copy.deepcopy(module)
            network_name = structure.network_name
            network = held.get_submodule(network_name) if network_name else held
            prefix = f"{network_name}." if network_name else ""
            stage_plan = partition_blocks(
                structure.num_blocks, p, virtual_pipeline_size, pipeline_partition,
                owner_style="v" if pipeline_schedule == "zbv_zero_bubble" else "loop",
            )  # fmt: skip
            split_network(network, structure.blocks_name[len(prefix) :], stage_plan, pr, root=held)
        names = {id(q): n for n, q in held.named_parameters()}
        modules = dict(held.named_modules())
        with torch.device("meta"):
            groups = [[q for q in g if q.requires_grad] for g in _optimizer_groups(held)]

        def local_shape(q: nn.Parameter, tr: int, names: dict = names, modules: dict = modules) -> list[int]:
            mod_name, _, leaf = names[id(q)].rpartition(".")
            return _tensor_parallel_shape(list(q.shape), styles.get(mod_name), modules[mod_name], leaf, t, tr)

        unique = list({id(q): q for q in held.parameters()}.values())
        experts = {id(q) for n in expert_names if _has_submodule(held, n)
                   for q in held.get_submodule(n).parameters(recurse=False)}  # fmt: skip
        for tr in range(t):
            for dr in range(d):
                rank = pr * d * t + dr * t + tr

                def shape_on(q: nn.Parameter, tr: int, dr: int = dr, experts: set = experts) -> list[int]:
                    if id(q) not in experts:
                        return local_shape(q, tr)
                    shape = list(q.shape)  # Shard(0) over the expert ranks: consecutive data-parallel ranks
                    shape[0] = _chunk(shape[0], ep, dr % ep)
                    return shape

                by_rank[rank] = _rank_bytes(unique, groups, shape_on, tr, dr, zero_stage, d, p, low, styles,
                                            names, overlap_grad_reduce, experts, ep)  # fmt: skip
    return [by_rank[r] for r in range(t * p * d)]


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:  # another pipeline stage's block
        return False
    return True


def _expert_names(module: nn.Module, ep: int, d: int) -> list[str]:
    """The experts modules expert parallel splits (none at ``ep=1``), refused as the strategy refuses them."""
    if ep == 1:
        return []
    from lightning_hybrid.expert_parallel.discover import find_expert_modules

    found, refused = find_expert_modules(module)
    why = None
    if d % ep:
        why = f"it must divide the data-parallel size ({d})"
    elif refused or not found:
        why = f"{type(module).__name__} has no experts module expert parallel can dispatch ({refused or 'none'})"
    elif any(e.num_experts % ep for e in found):
        why = f"it must divide every MoE layer's expert count ({sorted({e.num_experts for e in found})})"
    if why:
        raise HybridConfigError(f"`expert_parallel_size={ep}`: {why}.")
    return [e.name for e in found]


def _rank_bytes(params, groups, local_shape, tr, dr, zero, d, p, low, styles, names, overlap, experts,  # noqa: ANN001
                ep) -> dict[str, int]:  # fmt: skip
    from lightning_hybrid.tensor_parallel.plan import FusedColwiseParallel

    states = 2  # Adam/AdamW: exp_avg and exp_avg_sq (the step count is a scalar, not counted)
    if zero == 3:
        total_p = total_g = total_s = 0
        for q in params:
            shape = local_shape(q, tr)
            strided = isinstance(styles.get(names[id(q)].rpartition(".")[0]), FusedColwiseParallel)
            if id(q) in experts:  # an FSDP2 unit of its own over the dp / ep ranks holding the same experts
                shape[0] = _chunk(shape[0], d // ep, dr // ep)
                n = _numel(shape)
            elif strided and len(shape) < 2:  # fused tensor-parallel biases: left out of FSDP2, replicated
                n = _numel(shape)
            else:
                dim = 1 if strided else 0  # fused weights: FSDP2 shards them on dim 1 (sharding/fsdp.py)
                shape[dim] = _chunk(shape[dim], d, dr)
                n = _numel(shape)
            total_p += 4 * n
            if q.requires_grad:
                total_g += 4 * n
                total_s += 4 * states * n
        return {"parameters": total_p, "gradients": total_g, "optimizer_state": total_s,
                "total": total_p + total_g + total_s}  # fmt: skip
    param_bytes = 2 if low else 4
    parameters = sum(param_bytes * _numel(local_shape(q, tr)) for q in params)
    uses_masters = (zero >= 1 and d > 1) or low  # one replica steps as stage 0 (sharding/sharded_optimizer.py)
    gradients = state = 0
    buckets = zero == 0 and not uses_masters and d > 1 and p == 1 and overlap
    # each optimizer group is two flat groups under expert parallel: dense weights over all dp ranks, expert weights
    # over the dp / ep ranks holding the same experts (sharding/sharded_optimizer.py)
    flat = [(part, size) for group in groups
            for part, size in (([q for q in group if id(q) not in experts], d),
                               ([q for q in group if id(q) in experts], d // ep)) if part]  # fmt: skip
    for group, ranks in flat:
        numel = sum(_numel(local_shape(q, tr)) for q in group)
        shard = -(-numel // ranks) if zero >= 1 else numel
        padded = shard * ranks if zero >= 1 else shard
        if uses_masters and group:
            state += 4 * shard * (states + 1)  # the fp32 master of the shard and its optimizer state
        else:
            state += 4 * states * numel
        if buckets or not uses_masters:
            gradients += 4 * numel
        elif zero == 2:
            gradients += 4 * shard  # only the reduce-scattered shard stays
        else:
            gradients += 4 * padded  # ZeRO-1 keeps the full flat (padded) buffer until the step; '-true' at 0 too
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": state,
            "total": parameters + gradients + state}  # fmt: skip
