"""Plan a layout before launching: the per-device memory ledger, an estimated step time, and a verdict per layout.

Modules: ``hardware`` (devices and presets), ``model`` (sizes from raw numbers, a Hugging Face config or a module on
the meta device), ``ledger`` (model state per ZeRO stage under TP/PP, exact per rank from a module), ``activations``
(saved bytes per block and the schedule's in-flight micro-batches), ``steptime``, ``search`` (candidates, ranking,
decision rules), ``report`` (table, JSON, PNG), ``command`` (``lightning-hybrid plan``), ``auto``
(``HybridStrategy(layout="auto")``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from torch import nn

from lightning_hybrid.config import HybridConfigError
from lightning_hybrid.planning.hardware import GB, PRESETS, Hardware
from lightning_hybrid.planning.ledger import Ledger, predict_model_state_bytes, state_bytes_per_parameter
from lightning_hybrid.planning.model import ModelSpec, build_on_meta
from lightning_hybrid.planning.report import Plan
from lightning_hybrid.planning.search import Candidate, Setup, decision_rule, expert_refusal, search

__all__ = ["GB", "PRESETS", "Hardware", "Ledger", "ModelSpec", "Plan", "plan", "predict_model_state_bytes",
           "state_bytes_per_parameter"]  # fmt: skip


def _spec(
    model: Any, init_args: Optional[dict], hf_config: Any, sizes: dict[str, Any], seq: Optional[int]
) -> ModelSpec:
    given = {k: v for k, v in sizes.items() if v is not None}
    if sum(x is not None for x in (model, hf_config)) + bool(given.keys() - {"params"}) > 1:
        raise HybridConfigError("Give the model one way: `model` (class path or module), `hf_config`, or raw sizes.")
    if isinstance(model, ModelSpec):
        spec = model
    elif model is not None:
        module = build_on_meta(model, init_args) if isinstance(model, str) else model
        if not isinstance(module, nn.Module):
            raise HybridConfigError(f"`model` must be a class path, an nn.Module or a ModelSpec, got {model!r}.")
        spec = ModelSpec.from_module(module, seq)
    elif hf_config is not None:
        spec = ModelSpec.from_hf_config(hf_config, seq)
    else:
        missing = [k for k in ("layers", "hidden", "heads") if k not in given]
        if missing:
            raise HybridConfigError(f"Raw sizes need {missing} (or give `model` / `hf_config`).")
        spec = ModelSpec(seq=seq or 2048, **given)
    if "params" in given and not isinstance(model, ModelSpec) and (model is not None or hf_config is not None):
        from dataclasses import replace

        spec = replace(spec, params=float(given["params"]))
    return spec if seq is None else spec.with_seq(seq)


def plan(
    model: Union[str, nn.Module, ModelSpec, None] = None,
    *,
    init_args: Optional[dict[str, Any]] = None,
    hf_config: Union[str, Path, dict, None] = None,
    params: Optional[float] = None,
    layers: Optional[int] = None,
    hidden: Optional[int] = None,
    heads: Optional[int] = None,
    kv_heads: Optional[int] = None,
    ffn: Optional[int] = None,
    vocab: Optional[int] = None,
    seq: Optional[int] = None,
    family: Optional[str] = None,
    experts: Optional[int] = None,
    top_k: Optional[int] = None,
    expert_ffn: Optional[int] = None,
    shared_experts: Optional[int] = None,
    shared_ffn: Optional[int] = None,
    dense_layers: Optional[int] = None,
    micro_batch: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    recompute: Optional[str] = None,
    device_memory: Optional[float] = None,
    devices_per_node: Optional[int] = None,
    nodes: int = 1,
    gpu: str = "H100",
    intra_node_bandwidth: Optional[float] = None,
    inter_node_bandwidth: Optional[float] = None,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    data_parallel_size: Optional[int] = None,
    zero_stage: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    attention: Optional[str] = None,
    dropout: Optional[bool] = None,
    mfu: float = 0.4,
    sequence_parallel: bool = True,
    expert_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
) -> Plan:
    """Rank every layout of a cluster for a model: per-device ledger, estimated step time, and why each that does
    not fit fails.

    The model is a class path built on the meta device (``init_args`` for its constructor), an ``nn.Module``, a
    Hugging Face config (dict, ``config.json`` or a folder), or raw sizes (``layers``, ``hidden``, ``heads``...;
    ``params`` overrides the derived parameter count). ``device_memory`` is in GB (default: the ``gpu`` preset's);
    bandwidths in GB/s. ``recompute`` None tries ``none``, ``selective`` and ``full``. ``attention``: ``"eager"``
    (scores stored, Korthikanti et al.'s formula; the default for raw sizes) or ``"flash"`` (fused, the default for a
    module or HF config); ``dropout`` likewise (masks stored). ``sequence_parallel``: under tensor parallel, plan
    with the norms' activations split too (the strategy's ``sequence_parallel=True``).

    ``family`` (raw sizes): ``"gpt"`` (the default) or ``"llama"`` blocks (:class:`ModelSpec`).

    Mixture of experts (raw sizes ``experts``, ``top_k``, ``expert_ffn``, ``shared_experts``, ``shared_ffn``,
    ``dense_layers``; or read from the HF config or module): layouts with expert parallel are searched too, over the
    powers of two dividing both the data-parallel size and the expert count, unless ``expert_parallel_size`` fixes
    it (1: none). ``context_parallel_size`` (fixed, not searched) splits each sample's sequence: activations per
    rank are those of seq / cp tokens, ZeRO shards over replicas x context ranks. Layouts the strategy refuses (with
    tensor parallel, expert parallel needs ``sequence_parallel=False``; not with '-true' precisions) are not ranked.

    Example:
        >>> p = plan(params=6.7e9, layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, micro_batch=1,
        ...          precision="bf16", recompute="full", nodes=1)
        >>> best = p.best.candidate
        >>> (best.tensor_parallel_size * best.pipeline_parallel_size * best.data_parallel_size, p.best.feasible)
        (8, True)
        >>> moe = plan(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, experts=8, top_k=2, seq=4096,
        ...            family="llama", gpu="H200", nodes=1, recompute="full", zero_stage=1,
        ...            tensor_parallel_size=1, pipeline_parallel_size=1)
        >>> [e.candidate.expert_parallel_size for e in moe.layouts]
        [8, 4, 2, 1]
    """
    sizes = {"params": params, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn,
             "vocab": vocab, "experts": experts, "top_k": top_k, "expert_ffn": expert_ffn,
             "shared_experts": shared_experts, "shared_ffn": shared_ffn, "dense_layers": dense_layers,
             "family": family}  # fmt: skip
    spec = _spec(model, init_args, hf_config, sizes, seq)
    raw = model is None and hf_config is None
    hw = Hardware.preset(gpu, nodes=nodes, devices_per_node=devices_per_node)
    from dataclasses import replace

    if device_memory is not None:
        hw = replace(hw, device_memory=float(device_memory) * GB, name=f"{device_memory:g} GB")
    if intra_node_bandwidth is not None:
        hw = replace(hw, intra_node_bandwidth=float(intra_node_bandwidth) * GB)
    if inter_node_bandwidth is not None:
        hw = replace(hw, inter_node_bandwidth=float(inter_node_bandwidth) * GB)
    if recompute not in (None, "none", "selective", "full"):
        raise HybridConfigError(f"`recompute={recompute!r}` must be 'none', 'selective' or 'full'.")
    setup = Setup(
        micro_batch=micro_batch,
        precision=precision,
        optimizer=optimizer,
        attention=attention or ("eager" if raw else "flash"),
        dropout=raw if dropout is None else dropout,
        schedule=schedule,
        virtual_stages=virtual_stages,
        mfu=mfu,
        sequence_parallel=sequence_parallel,
    )
    state_bytes_per_parameter(precision, optimizer, 0, 1)  # checks both names
    ep = expert_parallel_size
    if ep is not None:
        why = expert_refusal(spec, replace(setup, sequence_parallel=False), Candidate(1, 1, ep, 0, 1, "none",
                             expert_parallel_size=ep)) if ep >= 1 else "it must be a positive integer"  # fmt: skip
        if why:
            raise HybridConfigError(f"`expert_parallel_size={ep}`: {why}.")
    layouts = search(spec, hw, setup, tensor_parallel_size=tensor_parallel_size,
                     pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                     zero_stage=zero_stage, num_microbatches=num_microbatches, recompute=recompute,
                     expert_parallel_size=ep, context_parallel_size=context_parallel_size)  # fmt: skip
    if not layouts:
        moe = (f"; expert={ep} must divide the data-parallel size, and with tensor parallel it runs only without"
               " sequence parallel") if ep and ep > 1 else ""  # fmt: skip
        raise HybridConfigError(
            f"No layout of {hw.world_size} devices matches the fixed sizes (tensor={tensor_parallel_size},"
            f" pipeline={pipeline_parallel_size}, data={data_parallel_size}): their product must be"
            f" {hw.world_size}{moe}."
        )
    rule, reason = decision_rule(layouts, spec, hw)
    for e in layouts:
        e.rule = e is rule
    return Plan(spec, hw, setup, layouts, rule, reason)
