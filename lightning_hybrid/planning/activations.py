"""Activation memory: the bytes autograd saves for backward, per micro-batch and per stage, and how many micro-batches
a pipeline schedule keeps in flight.

Per block, in elements of ``s * b * h`` (sequence x micro-batch x hidden), what the backward of each op keeps:

- GPT block (LayerNorm, fused q|k|v, GELU MLP): the two norms' inputs and outputs (4), the q|k|v output
  (``1 + 2 kv/h``), the attention output (1), the GELU's input and output (``2 ffn/h``). With 2-byte activations,
  ``ffn = 4h``, dropout masks (1 byte, after attention and after the MLP) that is Korthikanti et al.'s ``34 s b h``.
- Llama block (RMSNorm, q/k/v with rotary embeddings, SwiGLU): each norm keeps its input, its normalised value and
  its output (6), attention keeps q, k, v (``1 + 2 kv/h``) and its output (1), SwiGLU keeps gate, SiLU(gate), up
  and their product (``4 ffn/h``).
- Attention scores: the eager softmax keeps ``a s^2 b`` scores (plus, with dropout, its mask and output: the
  ``5 a s / h`` term of Korthikanti et al.); fused (flash / SDPA) attention keeps only a float32 log-sum-exp per
  query and head.
- Under tensor parallel the attention and MLP interiors are split ``t`` ways; the norms' values (and masks) are
  split too only with sequence parallel (Korthikanti's ``10 + 24/t``).

- Mixture-of-experts block: the MLP's interior is that of each token's ``top_k`` experts, on the routed rows: per
  (token, expert) pair the row the expert reads (h), its SwiGLU interior (``4 expert_ffn``; ``2`` for GELU) and its
  output before the routing weight multiplies it (h); plus the router's float32 probabilities and top-k and the
  pairs' int64 indices (``4 E + 40 top_k`` bytes per token), and any shared expert as a dense MLP (with Qwen2-MoE's
  gate: its output and the sigmoid that scales it). Under tensor parallel without
  expert parallel the experts' interiors are split ``t`` ways (``moe_tp_experts``); with expert parallel each
  tensor rank holds its experts whole, so they are not. Uniform routing: a rank receives as many pairs as it sends.
  The dispatch's send and receive buffers (``2 top_k s b h`` values, one layer's at a time) are transient: the
  ledger counts them as a buffer.

Recompute: ``"selective"`` is the strategy's op-level policy (``activation_checkpointing.SelectivePolicy``): a block
keeps its input and the outputs of its matmuls, attention kernel and collectives, and recomputes the rest (norms,
activations, elementwise ops); ``"full"`` keeps each block's input only (``2 s b h`` bytes at 2 bytes) and recomputes
the block in backward, which then needs one block's activations at a time (a transient, counted by the ledger as a
buffer). Mixture-of-experts blocks under ``"selective"`` are counted from the same rule, not measured.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_hybrid.planning.model import ModelSpec

__all__ = ["Recompute", "block_bytes", "in_flight_microbatches", "stage_activation_bytes"]

Recompute = Literal["none", "selective", "full"]
Attention = Literal["flash", "eager"]


def block_bytes(
    spec: ModelSpec,
    micro_batch: int,
    *,
    act_bytes: int = 2,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    attention: Attention = "flash",
    dropout: bool = False,
    moe: bool = False,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> float:
    """Bytes one block saves for backward for one micro-batch on one tensor-parallel rank; ``moe``: a
    mixture-of-experts block of ``spec`` (its experts over ``expert_parallel_size`` ranks). Under context parallel
    ``spec.seq`` is this rank's part of the sequence, and attention's output is kept twice: as the fused kernel saved
    it (heads / cp over the whole sequence) and, exchanged back, as the output projection's input (measured:
    ``benchmarks/activation_memory.py``); on one rank the two share one storage.

    Example (Korthikanti et al. 2022, LLaMA-7B at s=2048, b=4: 34 + 5as/h = 114 bytes per s*b*h):
        >>> spec = ModelSpec(layers=32, hidden=4096, heads=32, ffn=4 * 4096, seq=2048)
        >>> round(block_bytes(spec, 4, attention="eager", dropout=True) / (2048 * 4 * 4096), 3)
        114.0
        >>> moe = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, family="llama",
        ...                 experts=8, top_k=2)
        >>> round(block_bytes(moe, 1, moe=True) / 2**20)  # Mixtral-8x7B: two experts' SwiGLU per token
        1297
    """
    s, b, h, t = spec.seq, micro_batch, spec.hidden, tensor_parallel_size
    sbh = s * b * h
    split = t if sequence_parallel else 1
    if recompute == "full":
        return act_bytes * sbh / split
    if recompute == "selective":
        return _selective_block_bytes(spec, micro_batch, act_bytes, t, sequence_parallel, attention, moe,
                                      expert_parallel_size)  # fmt: skip
    kv = spec.kv / spec.heads
    ffn = spec.ffn_size / h
    interior = 4 if spec.family == "llama" else 2  # SwiGLU: gate, SiLU(gate), up, product; GELU: input, output
    routed = 0.0  # the experts' rows, whole on every tensor rank (bytes)
    if moe and spec.is_moe:
        shared = spec.shared_experts * (spec.shared_ffn or spec.expert_ffn_size) / h
        ffn = shared  # the shared experts are dense MLPs, split over the tensor ranks
        k, expert = spec.top_k, interior * spec.expert_ffn_size / h
        expert_split = t if expert_parallel_size == 1 else 1
        # the router's float32 probabilities, top-k values, indices and their sum; the pairs' indices and weights
        routing = (4 * spec.experts + 40 * k + 4) * s * b
        gate = (act_bytes * sbh + 4 * s * b) if spec.shared_gate else 0  # its sigmoid and the output it scales
        routed = act_bytes * k * (2 + expert / expert_split) * sbh + routing + gate
    if spec.family == "llama":
        replicated, sharded, stats = 6.0, 2 + 2 * kv + interior * ffn, 2 * s * b * 4
    else:
        replicated, sharded, stats = 4.0, 2 + 2 * kv + interior * ffn, 4 * s * b * 4
    if context_parallel_size > 1:
        sharded += 1  # attention's output exchanged back to this rank's tokens: a copy of its own
    masks = 2 * sbh if dropout else 0
    if attention == "flash":
        scores = 4 * spec.heads * s * b / t  # float32 log-sum-exp per query and head
    else:
        per_score = act_bytes + ((1 + act_bytes) if dropout else 0)
        scores = per_score * spec.heads * s * s * b / t
    if attention == "eager":
        stats = 0.0  # Korthikanti et al. count no norm statistics; with eager scores they are < 0.1%
    return (act_bytes * replicated * sbh + masks + stats) / split + act_bytes * sharded * sbh / t + scores + routed


def _selective_block_bytes(
    spec: ModelSpec,
    micro_batch: int,
    act_bytes: int,
    t: int,
    sequence_parallel: bool,
    attention: Attention,
    moe: bool,
    expert_parallel_size: int,
) -> float:
    """What a block keeps under op-level selective recompute (``activation_checkpointing.SelectivePolicy``): its
    input, every linear layer's output, the fused attention kernel's output and float32 log-sum-exp (eager
    attention's scores and their product with the values are recomputed) and every collective's result; the norms,
    activations and elementwise ops are recomputed. Under tensor parallel a row-wise layer's matmul output is the
    whole-size partial sum and its all-reduce a second copy; with sequence parallel the input and the
    reduce-scatters are split, and the all-gathers before attention and the MLP are whole."""
    s, b, h = spec.seq, micro_batch, spec.hidden
    sbh = s * b * h
    kv, ffn = spec.kv / spec.heads, spec.ffn_size / h
    colwise_mlp = 2 if spec.family == "llama" else 1  # gate and up, or fc
    if t == 1:
        whole, split_t = 3.0, 0.0  # the input, the attention's and the MLP's output projections
    elif not sequence_parallel:
        whole, split_t = 5.0, 0.0  # the input, two partial sums and their two all-reduces
    else:
        whole, split_t = 4.0, 3.0  # two all-gathers and two partial sums; the input and two reduce-scatters split
    # q, k, v and the fused attention's output (eager attention's batched matmuls are recomputed); gate and up (or
    # fc): split over the tensor ranks
    sharded = 1 + 2 * kv + (1 if attention == "flash" else 0)
    mlp = colwise_mlp * ffn
    if moe and spec.is_moe:
        # each (token, expert) pair: its gate|up and down outputs; the router's logits; shared experts as dense
        shared = spec.shared_experts * (spec.shared_ffn or spec.expert_ffn_size) / h
        expert_split = t if expert_parallel_size == 1 else 1
        # per rank, in units of s*b*h: each pair's matmul outputs and the router's logits (not divided by t below)
        routed = spec.top_k * (colwise_mlp * spec.expert_ffn_size / h / expert_split + 1) + spec.experts / h
        mlp = colwise_mlp * shared + routed * t
    scores = 4 * spec.heads * s * b / t if attention == "flash" else 0.0  # the fused kernel's log-sum-exp
    return act_bytes * sbh * (whole + split_t / t + (sharded + mlp) / t) + scores


def in_flight_microbatches(schedule: str, pipeline_parallel_size: int, num_microbatches: int, virtual: int = 1,
                           stage: int = 0) -> float:  # fmt: skip
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak, in units of all its blocks.

    GPipe runs every forward first (``m``); 1F1B keeps ``p - stage`` (at most ``m``); the interleaved schedules keep
    Megatron's warm-up count of model chunks, ``2(p - 1 - stage) + (v - 1)p + 1``, each ``1/v`` of the rank's
    blocks; zero-bubble V keeps 1F1B's ``p`` (Qi et al. 2024). Without pipeline parallel, one.

    Example:
        >>> in_flight_microbatches("1f1b", 4, 16), in_flight_microbatches("gpipe", 4, 16)
        (4, 16)
        >>> in_flight_microbatches("interleaved_1f1b", 4, 16, virtual=2)
        5.5
    """
    p, m, v = pipeline_parallel_size, num_microbatches, virtual
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and v > 1:
        return min(m * v, 2 * (p - 1 - stage) + (v - 1) * p + 1) / v
    return min(m, p - stage)


def stage_activation_bytes(
    spec: ModelSpec,
    micro_batch: int,
    blocks: float,
    *,
    first: bool,
    last: bool,
    act_bytes: int = 2,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    vocab_parallel: bool = True,
    recompute: Recompute = "none",
    attention: Attention = "flash",
    dropout: bool = False,
    moe_blocks: float = 0,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> dict[str, float]:
    """Bytes one micro-batch saves on one stage holding ``blocks`` blocks, ``moe_blocks`` of them mixture-of-experts
    blocks: ``blocks``, ``inputs`` (token ids, position ids/rotary tables on the first stage), ``outputs`` (the final
    norm on the last stage) and ``logits`` (the head's output the loss keeps, split over the vocabulary under
    vocab-parallel tensor parallel).

    Example:
        >>> spec = ModelSpec(layers=2, hidden=64, heads=4, seq=16)
        >>> sorted(stage_activation_bytes(spec, 1, 2, first=True, last=True))
        ['blocks', 'inputs', 'logits', 'outputs']
    """
    s, b, h, t = spec.seq, micro_batch, spec.hidden, tensor_parallel_size
    split = t if sequence_parallel else 1
    kwargs: dict[str, Any] = {"act_bytes": act_bytes, "tensor_parallel_size": t, "sequence_parallel": sequence_parallel,
              "recompute": recompute, "attention": attention, "dropout": dropout,
              "context_parallel_size": context_parallel_size}  # fmt: skip
    per_block = block_bytes(spec, b, **kwargs)
    if moe_blocks:
        per_moe = block_bytes(spec, b, moe=True, expert_parallel_size=expert_parallel_size, **kwargs)
        per_block = (per_block * (blocks - moe_blocks) + per_moe * moe_blocks) / blocks
    inputs = outputs = logits = 0.0
    if first:
        inputs = 8 * s * b  # int64 token ids (the embedding's backward)
        if spec.position_embeddings:
            inputs += 8 * s
        if spec.family == "llama":
            inputs += 2 * act_bytes * s * spec.head_dim  # rotary cos and sin, shared by every block
    if last:
        norm = 3 if spec.family == "llama" else 2
        stats = (1 if spec.family == "llama" else 2) * 4 * s * b
        outputs = (act_bytes * norm * s * b * h + stats) / split
        vocab = spec.vocab / (t if vocab_parallel else 1)
        logits = act_bytes * s * b * vocab + 8 * s * b + 4  # log-softmax output, targets, the loss
    return {"blocks": per_block * blocks, "inputs": inputs, "outputs": outputs, "logits": logits}
