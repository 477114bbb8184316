"""Candidate layouts, their ledgers and step times, the verdict on each, and the seeds' decision rules."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Optional

from lightning_hybrid.config import HybridConfigError, PipelineOptions
from lightning_hybrid.layout import LayoutRequest
from lightning_hybrid.planning.activations import block_bytes, in_flight_microbatches, stage_activation_bytes
from lightning_hybrid.planning.hardware import GB, Hardware
from lightning_hybrid.planning.ledger import PRECISION_BYTES, Ledger, state_bytes_per_parameter
from lightning_hybrid.planning.model import ModelSpec
from lightning_hybrid.planning.steptime import StepTime, estimate_step_time
from lightning_hybrid.sharding.sharded_buckets import ShardedGradientBuckets

__all__ = ["Candidate", "Evaluated", "Setup", "decision_rule", "evaluate", "expert_refusal", "rank", "search"]

RECOMPUTES = ("none", "selective", "full")
BUCKET_BYTES = 25 * 2**20  # the strategy's default bucket_cap_mb


@dataclass(frozen=True)
class Setup:
    """The training set-up shared by every candidate."""

    micro_batch: int = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    attention: str = "flash"
    dropout: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    mfu: float = 0.4
    sequence_parallel: bool = True
    """Under tensor parallel, whether the norms' activations are split too (Megatron-SP; the strategy's
    ``sequence_parallel``)."""


@dataclass(frozen=True)
class Candidate:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    num_microbatches: int
    recompute: str
    schedule: str = "1f1b"
    virtual_stages: int = 1
    expert_parallel_size: int = 1
    """Data-parallel ranks each MoE layer's experts are split over (1: not split)."""
    context_parallel_size: int = 1
    """Ranks each sample's sequence is split over (fixed by the caller, not searched)."""

    def sizes(self) -> dict[str, int]:
        """The layout's sizes, keyed like ``HybridStrategy``'s arguments."""
        names = ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "zero_stage"]
        names += ["expert_parallel_size"] + (["context_parallel_size"] if self.context_parallel_size > 1 else [])
        return {k: getattr(self, k) for k in names}

    def describe(self) -> str:
        ep = f" ep{self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""
        ep += f" cp{self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        return (f"tp{self.tensor_parallel_size} x pp{self.pipeline_parallel_size} x dp{self.data_parallel_size}{ep}"
                f" zero{self.zero_stage} m{self.num_microbatches} {self.recompute}")  # fmt: skip


@dataclass
class Evaluated:
    candidate: Candidate
    ledger: Ledger
    step: Optional[StepTime]
    feasible: bool
    reason: str
    tokens: int
    rule: bool = False
    details: dict = field(default_factory=dict)

    @property
    def step_time(self) -> Optional[float]:
        return self.step.total if self.step is not None else None

    @property
    def seconds_per_token(self) -> float:
        return self.step.total / self.tokens if self.step is not None and self.tokens else math.inf


def _context_local(spec: ModelSpec, c: Candidate) -> ModelSpec:
    """Under context parallel each rank holds seq / cp tokens of every sample: its activations are those of a
    sequence cp times shorter (attention's heads / cp over the whole sequence save as much under flash attention;
    eager scores, heads / cp x seq^2, are counted cp times too small)."""
    return replace(spec, seq=spec.seq // c.context_parallel_size) if c.context_parallel_size > 1 else spec


def _stage_ledger(spec: ModelSpec, setup: Setup, c: Candidate, first: bool, last: bool) -> tuple[Ledger, dict]:
    t, p, ep = c.tensor_parallel_size, c.pipeline_parallel_size, c.expert_parallel_size
    # gradients average, and ZeRO shards, over the mesh's data dimension: replicas x context ranks
    d = c.data_parallel_size * c.context_parallel_size
    spec = _context_local(spec, c)
    blocks = math.ceil(spec.layers / p)
    start = 0 if first else spec.layers - blocks
    dense_params, expert_params = spec.stage_params(start, start + blocks)
    moe_blocks = sum(1 for i in spec.moe_layer_indices if start <= i < start + blocks)
    numel = dense_params / t
    if first:
        numel += spec.embedding_params / t
    if last:
        numel += spec.head_params / t
    # experts: 1/ep of them whole on every tensor rank under expert parallel, else split by moe_tp_experts
    expert_numel = expert_params / (ep if ep > 1 else t)
    per = state_bytes_per_parameter(setup.precision, setup.optimizer, c.zero_stage, d)
    per_expert = state_bytes_per_parameter(setup.precision, setup.optimizer, c.zero_stage, d, expert_parallel_size=ep)
    state = {k: per[k] * numel + per_expert[k] * expert_numel for k in per}
    act_bytes = PRECISION_BYTES[setup.precision][3]
    sp = t > 1 and setup.sequence_parallel
    stage = 0 if first else p - 1
    flight = in_flight_microbatches(c.schedule, p, c.num_microbatches, c.virtual_stages, stage)
    kwargs = {"act_bytes": act_bytes, "tensor_parallel_size": t, "sequence_parallel": sp,
              "attention": setup.attention, "dropout": setup.dropout,
              "context_parallel_size": c.context_parallel_size}  # fmt: skip
    acts = stage_activation_bytes(spec, setup.micro_batch, blocks, first=first, last=last, recompute=c.recompute,
                                  moe_blocks=moe_blocks, expert_parallel_size=ep, **kwargs)  # fmt: skip
    activations = flight * (acts["blocks"] + acts["inputs"] + acts["outputs"])
    buffers = {"logits": acts["logits"] * (c.num_microbatches if c.schedule == "gpipe" and p > 1 else 1)}
    if c.recompute != "none":  # backward recomputes one block at a time: what it recomputes exists meanwhile
        one = {"moe": moe_blocks > 0, "expert_parallel_size": ep, **kwargs}
        kept = block_bytes(spec, setup.micro_batch, recompute="selective", **one) if c.recompute == "selective" else 0
        buffers["recompute"] = block_bytes(spec, setup.micro_batch, **one) - kept
    if c.zero_stage == 3 and d > 1:
        # FSDP2 gathers a block (and prefetches the next); under pipeline parallel the stage's blocks stay gathered.
        # Expert weights are gathered over the dp / ep ranks holding them
        if p > 1:
            gathered = (dense_params, expert_params)
        else:
            biggest = max(range(spec.layers), key=lambda i: sum(spec.block_params(i)))
            gathered = tuple(2 * x for x in spec.block_params(biggest))
        de = d // ep
        dense_part = gathered[0] / t * (d - 1) / d
        expert_part = gathered[1] / (ep if ep > 1 else t) * (de - 1) / de
        buffers["zero3_gather"] = act_bytes * (dense_part + expert_part)
    if d > 1 and c.zero_stage in (1, 2, 3):
        # ZeRO-2 without a pipeline reduces bucket by bucket during backward: those in flight and the one filling
        # (not with expert weights: their groups reduce after the last backward pass)
        in_use = ShardedGradientBuckets.MAX_IN_FLIGHT + 1 if c.zero_stage == 2 and p == 1 and ep == 1 else 2
        buffers["buckets"] = in_use * BUCKET_BYTES
    if ep > 1 and moe_blocks:  # the dispatch's rows sent and received, one MoE layer at a time
        buffers["dispatch"] = 2 * spec.top_k * setup.micro_batch * spec.seq * spec.hidden * act_bytes
    # set-up (deferred construction): the shards plus the replay's one full tensor in flight, in the parameters' dtype
    packed = spec.experts * (2 if spec.family == "llama" else 1) * spec.expert_ffn_size  # a gate|up expert tensor
    largest = max(spec.vocab * spec.hidden, spec.hidden * (spec.ffn or 4 * spec.hidden), spec.hidden * packed)
    setup_bytes = state["parameters"] + largest * PRECISION_BYTES[setup.precision][0]
    ledger = Ledger(state["parameters"], state["gradients"], state["master"], state["optimizer"], activations,
                    sum(buffers.values()), setup_bytes)  # fmt: skip
    return ledger, {"buffers": buffers, "in_flight": flight, "numel": numel + expert_numel,
                    "expert_numel": expert_numel}  # fmt: skip


def expert_refusal(spec: ModelSpec, setup: Setup, c: Candidate) -> Optional[str]:
    """Why the strategy would refuse ``c``'s expert parallel (None when it would run it): such layouts are not
    ranked.

    Example:
        >>> spec = ModelSpec(layers=2, hidden=64, heads=4, family="llama", experts=8, top_k=2)
        >>> expert_refusal(spec, Setup(sequence_parallel=False), Candidate(2, 1, 4, 1, 1, "none",
        ...                expert_parallel_size=4))
        >>> expert_refusal(spec, Setup(), Candidate(2, 1, 4, 1, 1, "none", expert_parallel_size=4))
        'expert_parallel_size=4 does not run with sequence_parallel=True (plan with sequence_parallel=False)'
    """
    ep, d = c.expert_parallel_size, c.data_parallel_size
    if ep == 1:
        return None
    if not spec.is_moe:
        return f"expert_parallel_size={ep}, but the model has no mixture-of-experts layer"
    if d % ep:
        return f"expert_parallel_size={ep} does not divide data_parallel_size={d}"
    if spec.experts % ep:
        return f"expert_parallel_size={ep} does not divide the {spec.experts} experts"
    if c.tensor_parallel_size > 1 and setup.sequence_parallel:
        return f"expert_parallel_size={ep} does not run with sequence_parallel=True (plan with sequence_parallel=False)"
    return None


def _structural_reason(spec: ModelSpec, hw: Hardware, setup: Setup, c: Candidate) -> Optional[str]:
    """Why the strategy would refuse ``c`` for this model, or why the cluster cannot hold it (None: neither). The
    layout's own arguments go through the strategy's validation (``LayoutRequest``), so a rule added there holds here
    too; the model's sizes are checked as the tensor-parallel plan checks them (heads, hidden, FFN, vocabulary)."""
    t, p = c.tensor_parallel_size, c.pipeline_parallel_size
    if t > hw.devices_per_node:
        return f"tensor_parallel_size={t} exceeds the {hw.devices_per_node} devices of a node"
    try:
        LayoutRequest(
            **c.sizes(),
            sequence_parallel=setup.sequence_parallel and t > 1,
            pipeline=PipelineOptions(num_microbatches=c.num_microbatches, schedule=c.schedule,
                                     virtual_pipeline_size=c.virtual_stages),
        ).resolve(hw.world_size)  # fmt: skip
    except HybridConfigError as refusal:
        return f"refused by HybridStrategy: {str(refusal).split('. ')[0]}"
    widths = {"heads": spec.heads, "kv_heads": spec.kv, "hidden": spec.hidden, "ffn": spec.ffn or 4 * spec.hidden,
              "vocab": spec.vocab}  # fmt: skip
    uneven = [f"{k}={v}" for k, v in widths.items() if v % t]
    if uneven:
        return f"tensor_parallel_size={t} does not divide {', '.join(uneven)}"
    cp = c.context_parallel_size
    if spec.heads % (t * cp) or spec.seq % cp:
        return f"tensor x context parallel ({t} x {cp}) does not divide heads={spec.heads}, or {cp} seq={spec.seq}"
    if spec.layers < p * c.virtual_stages:
        return f"{spec.layers} layers cannot fill {p * c.virtual_stages} pipeline stages"
    return None


def _gb(x: float) -> str:
    """Decimal GB, or MB/KB for the tiny models of tests and examples."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= 0.1 * size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def evaluate(spec: ModelSpec, hw: Hardware, setup: Setup, c: Candidate) -> Evaluated:
    """The ledger of the most loaded device (first or last stage), the step time and the verdict."""
    p = c.pipeline_parallel_size
    stages = [(True, True)] if p == 1 else [(True, False), (False, True)]
    ledgers = [_stage_ledger(spec, setup, c, first, last) for first, last in stages]
    ledger, details = max(ledgers, key=lambda x: x[0].peak)
    tokens = c.data_parallel_size * c.num_microbatches * setup.micro_batch * spec.seq
    structural = _structural_reason(spec, hw, setup, c)
    if structural:
        return Evaluated(c, ledger, None, False, structural, tokens, details=details)
    grad_bytes = PRECISION_BYTES[setup.precision][1]
    # per rank: seq / cp tokens, gradients reduced over replicas x context ranks
    step = estimate_step_time(_context_local(spec, c), hw, tensor_parallel_size=c.tensor_parallel_size,
                              pipeline_parallel_size=p, zero_stage=c.zero_stage,
                              data_parallel_size=c.data_parallel_size * c.context_parallel_size,
                              micro_batch=setup.micro_batch, num_microbatches=c.num_microbatches,
                              grad_bytes=grad_bytes, act_bytes=PRECISION_BYTES[setup.precision][3],
                              schedule=c.schedule, virtual=c.virtual_stages, recompute=c.recompute,
                              mfu=setup.mfu, expert_parallel_size=c.expert_parallel_size,
                              context_parallel_size=c.context_parallel_size)  # fmt: skip
    limit = f"{_gb(hw.device_memory).replace('.0 ', ' ')} x {hw.usable_fraction:g}"
    if ledger.setup > hw.usable_memory >= ledger.training:
        reason = f"set-up (shards + the replay's largest tensor) {_gb(ledger.setup)} > {limit}"
        return Evaluated(c, ledger, step, False, reason, tokens, details=details)
    if ledger.peak > hw.usable_memory:
        parts = {
            "parameters": ledger.parameters,
            "gradients": ledger.gradients,
            "master weights": ledger.master,
            "optimizer state": ledger.optimizer,
            "activations": ledger.activations,
            "buffers": ledger.buffers,
        }
        terms = " + ".join(
            f"{k} {_gb(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.005 * ledger.peak
        )
        return Evaluated(c, ledger, step, False, f"{terms} = {_gb(ledger.peak)} > {limit}", tokens, details=details)
    return Evaluated(c, ledger, step, True, f"peak {_gb(ledger.peak)} <= {limit}", tokens, details=details)


def _powers_of_two_upto(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1) if n % 2**i == 0]


def search(
    spec: ModelSpec,
    hw: Hardware,
    setup: Setup,
    *,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    data_parallel_size: Optional[int] = None,
    zero_stage: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    recompute: Optional[str] = None,
    expert_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
) -> list[Evaluated]:
    """Every layout of the cluster (tensor parallel within a node, any pipeline depth dividing the rest, for a
    mixture-of-experts model expert parallel over a power of two dividing the data-parallel size and the expert
    count), each given dimension fixed; ranked: feasible layouts by estimated time per token, then the infeasible by
    peak memory. Layouts the strategy would refuse (:func:`expert_refusal`) are left out. ``context_parallel_size``
    is fixed: the other sizes divide the world / cp."""
    cp = context_parallel_size
    world = hw.world_size // cp
    tps = [tensor_parallel_size] if tensor_parallel_size else _powers_of_two_upto(min(world, hw.devices_per_node))
    out: list[Evaluated] = []
    for t in tps:
        if world % t:
            continue
        pps = [pipeline_parallel_size] if pipeline_parallel_size else [q for q in range(1, world // t + 1)
                                                                        if (world // t) % q == 0]  # fmt: skip
        for p in pps:
            if world % (t * p):
                continue
            d = world // (t * p)
            if data_parallel_size and d != data_parallel_size:
                continue
            # 4 micro-batches per stage: the 1F1B bubble (p-1)/m under a fifth; 1F1B holds at most p in flight anyway
            m = num_microbatches or (4 * p if p > 1 else 1)
            zeros = [zero_stage] if zero_stage is not None else ([0, 1, 2, 3] if d > 1 else [0])
            if expert_parallel_size:
                eps = [expert_parallel_size]
            else:
                eps = [e for e in _powers_of_two_upto(d) if e == 1 or (spec.is_moe and spec.experts % e == 0)]
            for z, ep, r in itertools.product(zeros, eps, [recompute] if recompute else RECOMPUTES):
                c = Candidate(t, p, d, z, m, r, setup.schedule if p > 1 else "1f1b", setup.virtual_stages
                              if p > 1 else 1, ep, cp)  # fmt: skip
                if cp > 1 and ep > 1:  # the strategy refuses it
                    continue
                if expert_refusal(spec, setup, c) is None:
                    out.append(evaluate(spec, hw, setup, c))
    return rank(out)


def rank(evaluated: list[Evaluated]) -> list[Evaluated]:
    return sorted(evaluated, key=lambda e: (not e.feasible, e.seconds_per_token if e.feasible else e.ledger.peak))


def decision_rule(evaluated: list[Evaluated], spec: ModelSpec, hw: Hardware) -> tuple[Optional[Evaluated], str]:
    """The seeds' rules of thumb, applied to the evaluated layouts (least recompute first):

    1. a model that fits on one device gets data parallel;
    2. a model where one layer fits gets ZeRO-3 (over every device);
    3. otherwise tensor parallel inside a node, pipeline across nodes, and data parallel over the rest.

    The rules choose among layouts without expert parallel; the ranking weighs those with it.
    """
    evaluated = [e for e in evaluated if e.candidate.expert_parallel_size == 1]  # the rules predate expert parallel
    by_recompute = {r: [e for e in evaluated if e.candidate.recompute == r] for r in RECOMPUTES}
    for r in RECOMPUTES:
        group = by_recompute[r]
        single = [e for e in group if e.candidate.tensor_parallel_size == e.candidate.pipeline_parallel_size == 1]
        replicated = [e for e in single if e.candidate.zero_stage == 0 and e.feasible]
        if replicated:
            return replicated[0], f"rule 1: the model fits on one device (recompute {r}): data parallel"
        zero3 = [e for e in single if e.candidate.zero_stage == 3 and e.feasible]
        if zero3:
            return zero3[0], f"rule 2: one layer fits, the model does not (recompute {r}): ZeRO-3 over every device"
        runnable = [
            e.candidate.tensor_parallel_size for e in group if not _structural_reason(spec, hw, Setup(), e.candidate)
        ]
        tp = max((t for t in runnable if t <= hw.devices_per_node), default=1)
        rule3 = [e for e in group if e.candidate.tensor_parallel_size == tp and e.feasible
                 and e.candidate.pipeline_parallel_size >= hw.nodes and e.candidate.zero_stage <= 1]  # fmt: skip
        if rule3:
            best = min(rule3, key=lambda e: (e.candidate.pipeline_parallel_size, -e.candidate.zero_stage))
            return best, (f"rule 3: neither fits (recompute {r}): tensor parallel inside a node, pipeline across"
                          " nodes, data parallel over the rest")  # fmt: skip
    return None, "no rule gives a feasible layout"
