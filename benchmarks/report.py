"""The "Side by side" section of docs/benchmarks.md and its pictures, from the records of :mod:`benchmarks.compare`.

Example:
    >>> _seconds(0.25)
    '250 ms'
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

from benchmarks import theory

SECTION_BEGIN = "<!-- side_by_side: begin (written by benchmarks/run_all.py) -->"
SECTION_END = "<!-- side_by_side: end -->"
COMMUNICATION_TARGET = 1.10
MODEL_STATE_TARGET = 0.05
BUBBLE_TARGET_PP = 10.0


def _seconds(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


def _bytes(x: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _mark(ok: Optional[bool]) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def _own_settings(results: dict[str, Any], settings: dict[str, Any]) -> str:
    """The rows measured with more steps or rounds than the rest (``benchmarks.compare.measurement``), as a
    sentence."""
    own = [
        f"{name} ({s['steps_per_round']} steps, {s['rounds']} rounds)"
        for name, s in results["summaries"].items()
        if "error" not in s and (s["steps_per_round"], s["rounds"]) != (settings["measured"], settings["rounds"])
    ]
    if not own:
        return ""
    return (
        " Rows whose step takes a few milliseconds, and those with a 1.00x target, are measured longer, so that"
        f" timer and scheduler noise weigh less: {', '.join(own)}."
    )


def _group_sizes(comparison: dict[str, Any]) -> dict[str, int]:
    s = comparison["a"]["strategy"]
    tp, pp = s.get("tensor_parallel_size", 1), s.get("pipeline_parallel_size", 1)
    return {"tensor": tp, "pipeline": pp, "data": comparison["world"] // (tp * pp), "world": comparison["world"]}


def communication_rows(comparison: dict[str, Any], record: dict[str, Any], model: dict[str, Any]) -> list[dict]:
    """Per mesh dimension: counted wire bytes per rank (the largest over ranks) against the minimum for the layout."""
    inputs = record.get("theory_inputs") or []
    if not inputs or any(i.get("communication") is None for i in inputs):
        return []
    sizes = _group_sizes(comparison)
    s = comparison["a"]["strategy"]
    zero = s.get("zero_stage", 1)
    per_replica = comparison["global_batch"] // sizes["data"]
    activation = per_replica * model["block_size"] * model["n_embd"] * 4
    rows = []
    for dim in ("data", "tensor", "pipeline"):
        if sizes[dim] <= 1:
            continue
        counted, minimum, detail = [], [], {}
        for rank_inputs in inputs:
            comm = rank_inputs["communication"]
            counted.append(sum(theory.wire_bytes(op, b, sizes[dim]) for (d, op), (_, b, _) in comm.items() if d == dim))
            for (d, op), (calls, b, _) in comm.items():
                if d == dim:
                    detail[op] = (max(detail.get(op, (0, 0))[0], calls), max(detail.get(op, (0, 0))[1], b))
            stages, num_stages = rank_inputs["stages"], rank_inputs["num_stages"]
            if dim == "data":
                numel_bytes = 4 * rank_inputs["local_numel"]
                minimum.append(theory.data_parallel_minimum(zero_stage=zero, gradient_bytes=numel_bytes,
                                                            parameter_bytes=numel_bytes,
                                                            data_parallel_size=sizes["data"]))  # fmt: skip
            elif dim == "tensor":
                blocks = model["n_layer"] // num_stages * len(stages)
                minimum.append(theory.tensor_parallel_minimum(activation_bytes=activation, blocks=blocks,
                                                              has_embedding=0 in stages,
                                                              has_head=num_stages - 1 in stages,
                                                              tensor_parallel_size=sizes["tensor"]))  # fmt: skip
            else:
                minimum.append(theory.pipeline_minimum(activation_bytes=activation, local_stages=stages,
                                                       num_stages=num_stages))  # fmt: skip
        ranks = [r for r in range(len(counted)) if minimum[r] > 0]
        if not ranks:
            continue
        worst = max(ranks, key=lambda r: counted[r] / minimum[r])  # the rank furthest above its minimum
        ratio = counted[worst] / minimum[worst]
        rows.append({"dimension": dim, "counted": counted[worst], "minimum": minimum[worst], "ratio": ratio,
                     "met": ratio <= COMMUNICATION_TARGET, "detail": detail, "rank": worst})  # fmt: skip
    return rows


def model_state_row(comparison: dict[str, Any], record: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Measured model-state bytes (``strategy.model_state_bytes``) against the ZeRO formula, worst rank."""
    from lightning_hybrid.sharding.memory import expected_model_state_bytes

    inputs = record.get("theory_inputs") or []
    if not inputs:
        return None
    sizes = _group_sizes(comparison)
    zero = comparison["a"]["strategy"].get("zero_stage", 1)
    worst: Optional[dict[str, Any]] = None
    for rank, rank_inputs in enumerate(inputs):
        measured = rank_inputs.get("model_state_bytes") or {}
        if not measured:
            continue
        expected = expected_model_state_bytes(rank_inputs["local_numel"], zero_stage=zero,
                                              data_parallel_size=sizes["data"])  # fmt: skip
        total = sum(expected.values())
        deviation = measured["total"] / total - 1
        if worst is None or abs(deviation) > abs(worst["deviation"]):
            worst = {"rank": rank, "measured": measured, "expected": expected, "expected_total": total,
                     "deviation": deviation}  # fmt: skip
    if worst is not None:
        worst["met"] = abs(worst["deviation"]) <= MODEL_STATE_TARGET
    return worst


def bubble_row(comparison: dict[str, Any], record: dict[str, Any]) -> Optional[dict[str, Any]]:
    if comparison["a"]["kind"] != "hybrid":
        return None
    s = comparison["a"]["strategy"]
    p = s.get("pipeline_parallel_size", 1)
    inputs = record.get("theory_inputs") or []
    bubbles = [i["bubble"] for i in inputs if i.get("bubble") is not None]
    if p <= 1 or not bubbles:
        return None
    schedule = s.get("pipeline_schedule", "1f1b")
    m, v = s.get("num_microbatches", p), s.get("virtual_pipeline_size", 1)
    formula = theory.theoretical_bubble(schedule, p, m, v)
    measured = statistics.median(bubbles)
    return {"schedule": schedule, "p": p, "m": m, "v": v, "measured": measured, "min": min(bubbles),
            "max": max(bubbles), "theory": formula,
            "difference_pp": None if formula is None else (measured - formula) * 100}  # fmt: skip


# Costs that profiling (cProfile on CPU time) found in a step of HybridStrategy and the Lightning loop around it,
# with where they live and what would remove them. Keys: (file, function) as the profile names them.
KNOWN_COSTS: dict[tuple[str, str], str] = {
    ("lightning_hybrid/sharding/norm.py", "total"): "`HybridStrategy.optimizer_step` (`lightning_hybrid/strategy.py`,"
    " `closure_then_reduce`) computes the global gradient norm on every step (`GradientNorm.total`: an fp64 pass over"
    " every gradient and an all-reduce over all ranks) when clipping by norm, with `track_gradient_norm=True` or on"
    " `HybridMonitor`'s logging steps",
    ("lightning_hybrid/sharding/memory.py", "measure_model_state_bytes"): "`HybridStrategy.optimizer_step`"
    " measures the model-state bytes (walks every parameter, gradient and optimizer state) on the first steps, until"
    " the sizes settle; a profile of the first steps still sees it",
    ("torch/distributed/device_mesh.py", "__getitem__"): "`HybridStrategy._run_step` slices"
    ' `self.device_mesh["data"]` on every step; in torch 2.13 each slice builds a new sub-mesh'
    " (`_create_sub_mesh`, milliseconds of CPU); slice once in `setup_environment` and keep the sub-meshes",
    ("lightning_hybrid/pipeline/runner.py", "_share_results"): "`PipelineRunner._share_results` sends the step's"
    " loss and logged values from the last stage to every stage (one tensor broadcast once the logged names are"
    " known, pickled objects on the first step) and replays `self.log` on every rank (Lightning's `log`; its"
    " `sync_dist` is one all-reduce over the data-parallel group through `HybridStrategy.reduce`, none without data"
    " parallel)",
    ("lightning_hybrid/pipeline/runner.py", "_capture"): "`PipelineRunner._capture` runs `training_step` up to the"
    " network call to learn its inputs, once per micro-batch on ranks holding a stage before the last",
    ("lightning_hybrid/pipeline/runner.py", "_take_gradients"): "`PipelineRunner._take_gradients` holds the step's"
    " gradients aside from Lightning's `zero_grad` between `training_step` and `backward`",
    ("lightning_hybrid/sharding/sharded_optimizer.py", "reduce_gradients"): "the ZeRO reduction after the backward"
    " pass (stages 1/2: flatten and reduce-scatter; stage 0 with buckets: waiting for buckets still in flight)",
    ("lightning_hybrid/sharding/buckets.py", "_end_of_backward"): "the end of the backward pass waits for the"
    " gradient buckets still in flight (the last bucket, the embeddings, cannot overlap) and averages them",
    ("lightning_hybrid/sharding/sharded_buckets.py", "_end_of_backward"): "the end of the backward pass waits for"
    " the ZeRO-2 buckets still in flight (the last bucket, the embeddings, cannot overlap) and adds their pieces into"
    " this rank's shard",
    ("lightning_hybrid/pipeline/stage.py", "active"): "`NetworkSplit.active` switches to the stage's prepared module"
    " swaps for every forward action",
    ("lightning/pytorch/loops/training_epoch_loop.py", "_broadcast_sigterm_tensor"): "Lightning's training loop"
    " broadcasts rank 0's SIGTERM flag before every batch and waits for it (a blocking collective under every"
    " distributed strategy; the references without Lightning have none)",
    ("lightning/pytorch/core/module.py", "log"): "Lightning's `self.log(..., sync_dist=True)` of the example's"
    " `training_step`: Lightning's result collection moving its stored metric to the value's device with"
    " `apply_to_collection` on every call (Lightning's own cost, paid under any strategy; the references without"
    " Lightning do not log) and the sync (`HybridStrategy.reduce`: one all-reduce over the data-parallel group"
    " where Lightning's `sync_ddp` makes a barrier and an all-reduce; none in a group of one)",
}


# Why counted communication exceeds the minimum, by (mesh dimension, ZeRO stage or None for any), read off the
# collectives the meter saw (the table's last column) and the code that issues them.
COMMUNICATION_CAUSES: dict[tuple[str, Optional[int], Optional[bool]], str] = {
    ("data", 3, True): "With a pipeline, FSDP2 gathers each stage's parameters again for every micro-batch:"
    " `fully_shard` is applied with its default `reshard_after_forward=True` (`apply_fully_shard` in"
    " `lightning_hybrid/sharding/fsdp.py` and `wrap_stage` in `HybridStrategy._build_runner`,"
    " `lightning_hybrid/strategy.py`), so the parameters are freed after each micro-batch's forward and gathered"
    " again for the next micro-batch and for each backward: about m all-gathers per step where the minimum is 2"
    " (torchtitan passes `reshard_after_forward=False` when pipeline parallel is on, trading memory for this"
    " traffic). The plain-torch 3D script uses the same default, so the step-time comparison is like for like.",
    ("data", 1, None): "ZeRO-1 all-reduces the whole gradient and then keeps only its shard"
    " (`ShardedOptimizer.reduce_gradients` in `lightning_hybrid/sharding/sharded_optimizer.py`, `all_reduce_mean`"
    " for stage 1), where a reduce-scatter (what stage 2 does) moves half the gradient bytes; with the parameter"
    " all-gather that is 1.5x the minimum. The full reduced gradient is what `gathered_gradients` and the global norm"
    " read.",
    ("data", 3, None): "FSDP2 gathers the parameters twice (forward, backward) and reduce-scatters the gradients; fused"
    " q|k|v biases split by tensor parallel are left out of FSDP2 and all-reduced on their own, and the loss and"
    " norm all-reduces add their few bytes.",
    ("tensor", None, None): "Beyond Megatron's count: the vocabulary-parallel loss's reductions per token, the gradient"
    " all-reduce of parameters replicated over the tensor dimension, and the global norm's all-reduce.",
    (
        "pipeline",
        None,
        None,
    ): "Beyond the boundary activations: the step's loss and logged values broadcast from the last"
    " stage (`PipelineRunner._share_results`), small.",
}


def known_costs(record: dict[str, Any], profiled_steps: int) -> list[tuple[float, tuple[str, str]]]:
    """(CPU seconds per step, key of ``KNOWN_COSTS``) found in the profile of A, the largest over ranks, largest
    first (cProfile with ``time.process_time``, cumulative time of the function)."""
    per_rank = (record.get("profile") or {}).get("a") or []
    found = []
    for (path, function), _ in KNOWN_COSTS.items():
        per_step = [
            sum(r[2] for r in rows if _same_file(r[0].split(":")[0], path) and r[0].endswith(f"({function})"))
            / profiled_steps
            for rows in per_rank
        ]
        if per_step and max(per_step) >= 0.5e-3:
            found.append((max(per_step), (path, function)))
    return sorted(found, reverse=True)


def _same_file(recorded: str, known: str) -> bool:
    # earlier runs recorded Lightning's files from "torch/" on (lightning/pytorch/... contains "torch/")
    return recorded == known or known.endswith(recorded)


def profile_lines(record: dict[str, Any], profiled_steps: int) -> list[str]:
    """One line per known cost found in the profile: CPU ms per step on the busiest rank."""
    return [f"{seconds * 1e3:.1f} ms: {KNOWN_COSTS[key]}" for seconds, key in known_costs(record, profiled_steps)]


def _figure_ratios(comparisons: list[dict[str, Any]], summaries: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in comparisons if "ratio" in summaries.get(c["name"], {})]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(done) + 1.5))
    for i, c in enumerate(done):
        s = summaries[c["name"]]
        color = "#55A868" if s["met"] else "#C44E52"
        ax.barh(i, s["ratio"], color=color)
        ax.plot([s["ratio_min"], s["ratio_max"]], [i, i], color="black", linewidth=1)
        ax.plot([c["target"]] * 2, [i - 0.4, i + 0.4], color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(done)), [f"{c['name']} vs {c['b']['kind']}" for c in done], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("step time, HybridStrategy / reference (median of rounds, min-max; dashed: target)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _figure_communication(rows: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    for i, (_, row) in enumerate(rows):
        ax.barh(i + 0.2, row["counted"] / 1e6, height=0.4, color="#4C72B0", label="counted" if i == 0 else None)
        ax.barh(i - 0.2, row["minimum"] / 1e6, height=0.4, color="#BBBBBB", label="minimum" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB on the wire per rank per step (ring algorithms; worst rank)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parameters(model: dict[str, Any]) -> int:
    """Parameters of the example network at ``model``'s sizes (built on the meta device: no memory, no time)."""
    import torch

    from examples.nanogpt import GPT, GPTConfig

    fields = {k: v for k, v in model.items() if k in GPTConfig.__dataclass_fields__}
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(GPTConfig(**fields)).parameters())


def gpu_lines(results: dict[str, Any]) -> list[str]:
    """GPU runs: tokens/s per GPU, MFU and peak memory of both contestants of every comparison."""
    from benchmarks.gpu_smoke import flops_per_token

    m, peak = results["machine"], results["machine"].get("peak_flops")
    lines = [
        "### Tokens/s per GPU, MFU and peak memory",
        "",
        f"{m.get('gpus')} x {m.get('gpu')}, NCCL, bf16-mixed for every contestant. MFU: model FLOPs per token"
        " (6 x parameters + attention, `benchmarks/gpu_smoke.py`) x tokens/s per GPU / the GPU's dense bf16 peak"
        + (f" ({peak / 1e12:.0f} TFLOP/s)." if peak else " (unknown for this GPU: pass `--peak-tflops`)."),
        "",
        "| comparison | HybridStrategy tokens/s/GPU | MFU | peak memory | reference tokens/s/GPU | MFU | peak memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in results["comparisons"]:
        s = results["summaries"].get(c["name"], {})
        if "a_median" not in s:
            continue
        model = results["models"][c["model"]]
        tokens = c["global_batch"] * model["block_size"] / c["world"]
        per_token = flops_per_token(model, _parameters(model))
        cells = []
        for side in ("a", "b"):
            rate = tokens / s[f"{side}_median"]
            mfu = f"{rate * per_token / peak * 100:.1f}%" if peak else "-"
            memory = s.get(f"{side}_peak_memory_bytes")
            cells += [f"{rate:,.0f}", mfu, f"{memory / 2**30:.2f} GiB" if memory else "-"]
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def section(results: dict[str, Any], figures_dir: Path, causes: dict[str, str]) -> str:
    """The markdown section; writes ``bench_step_time.png`` and ``bench_communication.png`` into ``figures_dir``."""
    comparisons, summaries, records = results["comparisons"], results["summaries"], results["records"]
    models, m = results["models"], results["machine"]
    settings = results["settings"]
    lines = [
        SECTION_BEGIN,
        "## Side by side",
        "",
        "`HybridStrategy` against what a user would pick instead, on the same model, data, global batch and"
        f" {'bf16-mixed' if m.get('device') == 'cuda' else 'fp32'} precision. Each comparison alternates fresh runs"
        " of the two (A B A B ...): a round trains"
        f" {settings['warmup'] + settings['measured'] + 1} batches, the first {settings['warmup'] + 1} are warm-up,"
        f" and the round's value is the median over the other {settings['measured']} of the slowest rank's time per"
        " step (for the Lightning runs: the end of one batch to the end of the next, so data loading and hooks count;"
        " for the references without Lightning: forward, backward and optimizer step). A cell is the median over"
        f" {settings['rounds']} rounds with the min-max; the ratio is the median of the per-round ratios, so drift of"
        " the machine between rounds cancels." + _own_settings(results, settings),
        f"Produced by `{results['command']}` in {results['wall_seconds'] / 60:.1f} min (this section; the pipeline"
        " bubble section below comes from the same command); the raw numbers are in"
        " `benchmarks/results/side_by_side.json`.",
        "",
        f"- **Machine**: {m['cores']}-core CPU ({m['cpu']}), {m['os']}; Python {m['python']}, torch {m['torch']},"
        f" Lightning {m['lightning']}, DeepSpeed {m.get('deepspeed') or 'not installed'}, lightning-hybrid"
        f" {m['lightning_hybrid']}; "
        + (
            f"NCCL, one of {m.get('gpus')} x {m.get('gpu')} per process"
            if m.get("device") == "cuda"
            else "gloo, 1 thread per process"
        )
        + ", processes started with `torchrun`."
        + (
            f" The ranks ran at autogroup nice {m['worker_autogroup_nice']} (`--priority`)."
            if m.get("worker_autogroup_nice") is not None
            else ""
        )
        + " Other processes used "
        + ", ".join(f"{v * 100:.0f}%" if v is not None else "-" for v in results["other_load"].values())
        + " of the machine's CPU time during the groups ("
        + ", ".join(results["other_load"])
        + ").",
        "- **Models** (`examples.nanogpt.NanoGPT`, fp32, AdamW lr 1e-3 as in its `configure_optimizers`): "
        + "; ".join(
            f"`{k}` {v['n_layer']} blocks of width {v['n_embd']}, {v['n_head']} heads, vocabulary {v['vocab_size']},"
            f" sequence {v['block_size']}"
            for k, v in models.items()
        )
        + ". Global batch 16 sequences (`tiny`: 8); the pipeline runs split it into 8 micro-batches (3D: 4).",
        "- **Targets**: step time <= 1.00x the Lightning strategy (or DeepSpeed engine) doing the same job, <= 1.05x"
        " the plain-torch loop of the same layout; communication <= 1.10x the minimum; model-state bytes within 5%"
        " of the formula; 1F1B bubble within 10 points of theory, interleaved below 1F1B.",
        "",
        "### Step time",
        "",
        "| comparison | layout | reference | HybridStrategy | reference | ratio | target | | CPU ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        s = summaries.get(c["name"])
        if s is None or "error" in s:
            lines.append(f"| {c['name']} | {c['layout']} | {c['reference']} | failed | | | {c['target']:.2f} | |")
            continue
        lines.append(
            f"| {c['name']} | {c['layout']} | {c['reference']} | {_seconds(s['a_median'])} ({_seconds(s['a_min'])}"
            f"-{_seconds(s['a_max'])}) | {_seconds(s['b_median'])} ({_seconds(s['b_min'])}-{_seconds(s['b_max'])})"
            f" | **{s['ratio']:.2f}x** ({s['ratio_min']:.2f}-{s['ratio_max']:.2f}) | <= {s['target']:.2f} |"
            f" {_mark(s['met'])} | {s['cpu_ratio']:.2f}x ({s['cpu_ratio_min']:.2f}-{s['cpu_ratio_max']:.2f}) |"
        )
    lines += [
        "",
        "The ratio and the target are on wall time. *CPU ratio*: the same for the CPU time of the busiest rank per step"
        " (`time.process_time`), which other jobs on a shared machine disturb far less: where the wall ratio and the"
        " CPU ratio disagree, the machine's load moved the wall time.",
        "",
        "![HybridStrategy step time over the reference's](figures/bench_step_time.png)",
        "",
    ]
    if m.get("device") == "cuda":
        lines += gpu_lines(results)
    host = summaries.get("host_overhead")
    host_c = next((c for c in comparisons if c["name"] == "host_overhead"), None)
    if host and "ratio" in host and host_c:
        mb = host_c["microbatches"]
        lines += [
            "### Host overhead per micro-batch",
            "",
            "The `tiny` model (4 blocks of width 16 on 1 sequence of 8 tokens per micro-batch) makes compute"
            " negligible, so a step's time is the Python and communication latency of strategy and schedule. Per"
            f" micro-batch (step time / {mb}, pipeline of 2, 1F1B), wall: HybridStrategy"
            f" **{host['a_median'] / mb * 1e6:.0f} us**, plain torch pipelining {host['b_median'] / mb * 1e6:.0f} us,"
            f" difference **{(host['a_median'] - host['b_median']) / mb * 1e6:.0f} us**; CPU of the busiest rank:"
            f" {host['cpu_a_median'] / mb * 1e6:.0f} us against {host['cpu_b_median'] / mb * 1e6:.0f} us, difference"
            f" **{(host['cpu_a_median'] - host['cpu_b_median']) / mb * 1e6:.0f} us**. The difference is Lightning's"
            " loop and `self.log` plus HybridStrategy's own per-step and per-micro-batch work (the miss list below"
            " names it). On a GPU whose forward+backward of a micro-batch takes less than that, it is idle GPU time.",
            "",
        ]
        floor, over = summaries.get("host_overhead_lightning_floor"), summaries.get("host_overhead_over_floor")
        if floor and over and "ratio" in floor and "ratio" in over:
            lines += [
                "The same step split in two. **Lightning's loop alone** (the same plain schedule inside a"
                " `training_step`, with automatic optimization and the example's one logged value as the example"
                " has them: no strategy code, the floor of any Lightning strategy for this module) takes"
                f" **{floor['ratio']:.2f}x** ({floor['ratio_min']:.2f}-{floor['ratio_max']:.2f}) of the plain loop;"
                f" **HybridStrategy over that floor** takes **{over['ratio']:.2f}x**"
                f" ({over['ratio_min']:.2f}-{over['ratio_max']:.2f}): per micro-batch about"
                f" {(over['a_median'] - over['b_median']) / mb * 1e6:.0f} us of the difference above is this"
                f" package's and {(floor['a_median'] - floor['b_median']) / mb * 1e6:.0f} us Lightning's"
                " (separate rows: the two need not add up to it exactly).",
                "",
            ]
            bare = summaries.get("host_overhead_lightning_floor_bare")
            if bare and "ratio" in bare:
                saved = (floor["a_median"] - bare["a_median"]) / mb * 1e6
                # separate rows, so the machine's drift between them can even invert the difference
                share = (
                    f"those two Lightning calls are about {saved:.0f} us per micro-batch of the floor (separate rows)"
                    if saved > 0
                    else "in this run the two rows differ by less than the machine's drift between them"
                )
                lines += [
                    "**The floor without Lightning's `self.log` and its per-batch SIGTERM broadcast** (an ablation:"
                    " the same loop with the module's one `self.log` left out and the epoch loop's broadcast of"
                    f" rank 0's SIGTERM flag made a no-op) takes **{bare['ratio']:.2f}x**"
                    f" ({bare['ratio_min']:.2f}-{bare['ratio_max']:.2f}) of the plain loop, against"
                    f" {floor['ratio']:.2f}x with them: {share}. Neither is a strategy's to remove: `self.log` is how"
                    " the module reports its loss to callbacks and loggers, and the broadcast is Lightning's"
                    " preemption handling.",
                    "",
                ]
    lines += [
        "### Communication per rank per step against the minimum",
        "",
        "Counted from the real calls of one step (`lightning_hybrid.monitoring.comm.CommunicationMeter`: c10d,"
        " DTensor's functional collectives, pipeline send/receive) and turned into bytes on the wire for ring"
        " algorithms (`benchmarks/theory.py`), against the fewest bytes the layout needs: data: all-reduce of the"
        " gradients (ZeRO 0), reduce-scatter + all-gather (ZeRO 1/2, the same volume), 1.5x that (ZeRO 3); tensor:"
        " 4 all-reduces of the activations per block per step (forward and backward) + embedding + head; pipeline:"
        " activations and their gradients across each stage boundary. Shown: the rank furthest above its minimum;"
        " the last column is the largest over ranks.",
        "",
        "| comparison | dimension | counted | minimum | ratio | calls x largest buffer (per collective) | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    comm_figure: list[tuple[str, dict[str, Any]]] = []
    for c in comparisons:
        rec = records.get(c["name"], {})
        rows = communication_rows(c, rec, models[c["model"]]) if "error" not in rec else []
        for row in rows:
            detail = ", ".join(f"{op} {calls}x{_bytes(b)}" for op, (calls, b) in sorted(row["detail"].items()))
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            lines.append(
                f"| {c['name']} | {row['dimension']} | {_bytes(row['counted'])} | {_bytes(row['minimum'])} | {ratio}"
                f" | {detail} | {_mark(row['met'])} |"
            )
            comm_figure.append((f"{c['name']} {row['dimension']}", row))
        if not rows and "error" not in rec and rec.get("theory_inputs"):
            lines.append(f"| {c['name']} | - | not counted (meter unavailable) | | | | |")
    lines += ["", "![Counted communication against the minimum](figures/bench_communication.png)", ""]
    lines += [
        "### Model-state bytes against the ZeRO formula",
        "",
        "`strategy.model_state_bytes` (parameters, gradients, optimizer state this rank holds after a step) against"
        " `lightning_hybrid.sharding.memory.expected_model_state_bytes` for the rank's parameters after tensor and"
        " pipeline parallel. Worst rank shown.",
        "",
        "| comparison | ZeRO | measured (params / grads / optimizer) | formula | difference | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        rec = records.get(c["name"], {})
        row = model_state_row(c, rec) if "error" not in rec else None
        if row is None:
            continue
        ms, ex = row["measured"], row["expected"]
        lines.append(
            f"| {c['name']} | {c['a']['strategy'].get('zero_stage', 1)} | {_bytes(ms['total'])}"
            f" ({_bytes(ms['parameters'])} / {_bytes(ms['gradients'])} / {_bytes(ms['optimizer_state'])}) |"
            f" {_bytes(row['expected_total'])} ({_bytes(ex['parameters'])} / {_bytes(ex['gradients'])} /"
            f" {_bytes(ex['optimizer_state'])}) | {row['deviation'] * 100:+.1f}% | {_mark(row['met'])} |"
        )
    lines += [
        "",
        "### Pipeline bubble of the compared runs",
        "",
        "`strategy.pipeline_timeline.bubble_fraction` of one step per rank (median, min-max over ranks) against"
        " `(p-1)/(v*m+p-1)`. The dedicated measurement with more steps and its analysis is the next section.",
        "",
        "| comparison | measured | theory | difference |",
        "| --- | --- | --- | --- |",
    ]
    bubbles = {}
    for c in comparisons:
        rec = records.get(c["name"], {})
        row = bubble_row(c, rec) if "error" not in rec else None
        if row is None:
            continue
        bubbles[c["name"]] = row
        formula = "-" if row["theory"] is None else f"{row['theory'] * 100:.1f}%"
        diff = "-" if row["difference_pp"] is None else f"{row['difference_pp']:+.1f} pp"
        lines.append(
            f"| {c['name']} | {row['measured'] * 100:.1f}% ({row['min'] * 100:.1f}%-{row['max'] * 100:.1f}%) |"
            f" {formula} | {diff} |"
        )
    cores = results["machine"].get("cores") or 0
    for p in (2, 4):
        one, inter = bubbles.get(f"pp{p}_1f1b"), bubbles.get(f"pp{p}_interleaved_1f1b")
        if one and inter:
            missed_bubble = inter["measured"] >= one["measured"] or abs(one["difference_pp"]) > BUBBLE_TARGET_PP
            why = ""
            if missed_bubble and cores and p > cores:
                why = (
                    f" Here {p} ranks share {cores} cores: a rank that waits for a neighbour whose process the"
                    " operating system has descheduled idles meanwhile, and the interleaved schedule, with more and"
                    " shorter actions and more ranks computing at once, loses most. The pipeline bubble section below"
                    " measures the same with more steps and a control run with one core per rank, where the bubble"
                    " follows the formula."
                )
            lines.append("")
            lines.append(
                f"p={p}: interleaved 1F1B {inter['measured'] * 100:.1f}% vs 1F1B {one['measured'] * 100:.1f}%:"
                f" {'below' if inter['measured'] < one['measured'] else '**not below**'} (target: below);"
                f" 1F1B {one['difference_pp']:+.1f} points from theory"
                f" ({'within' if abs(one['difference_pp']) <= BUBBLE_TARGET_PP else '**outside**'} 10).{why}"
            )
    lines += ["", "### Misses and their causes", ""]
    missed = [c for c in comparisons if summaries.get(c["name"], {}).get("met") is False]
    errors = [c for c in comparisons if "error" in summaries.get(c["name"], {"error": 1})]
    if not missed and not errors:
        lines.append("Every step-time target is met in this run.")
    if missed:
        lines += [
            "Where a ratio's min-max over rounds includes the target, the miss is within this machine's noise (the CPU"
            " ratio says more). The profiled costs are work HybridStrategy does every step that the reference does"
            " not, each with the code and the fix: CPU ms per step on the busiest rank from cProfile (CPU clock) of"
            " one more run of A. cProfile slows Python-heavy code more than tensor code, so read them as relative"
            " sizes; functions nest, so the lines overlap a little.",
            "",
        ]
    for c in missed:
        s = summaries[c["name"]]
        noise = " (within noise)" if s["ratio_min"] <= s["target"] else ""
        lines.append(
            f"- **{c['name']}**: {s['ratio']:.2f}x{noise}, CPU {s['cpu_ratio']:.2f}x, target {s['target']:.2f}x."
            f" {causes.get(c['name'], '')}"
        )
        record = records.get(c["name"], {})
        steps = record.get("profiled_steps", results["settings"]["profiled_steps"])  # a row may set its own
        lines.extend(f"  - {text}" for text in profile_lines(record, steps))
    for c in errors:
        error = summaries.get(c["name"], {}).get("error", "not run")
        last = [x for x in str(error).strip().splitlines() if x.strip()][-1:] or ["not run"]
        lines.append(f"- **{c['name']}** failed: `{last[0][:300]}`")
    comm_misses = [(label, row) for label, row in comm_figure if row["met"] is False]
    if comm_misses:
        lines += ["", "Communication above 1.10x the minimum:", ""]
    for label, row in comm_misses:
        name, dim = label.rsplit(" ", 1)
        strategy = next(c for c in comparisons if c["name"] == name)["a"]["strategy"]
        zero, pipelined = strategy.get("zero_stage", 1), strategy.get("pipeline_parallel_size", 1) > 1
        why = (
            COMMUNICATION_CAUSES.get((dim, zero, pipelined))
            or COMMUNICATION_CAUSES.get((dim, zero, None))
            or COMMUNICATION_CAUSES.get((dim, None, None), "")
        )
        lines.append(f"- **{name}**, {dim}: {row['ratio']:.2f}x. {why}")
    lines += ["", SECTION_END]
    figures_dir.mkdir(parents=True, exist_ok=True)
    _figure_ratios(comparisons, summaries, figures_dir / "bench_step_time.png")
    _figure_communication(comm_figure, figures_dir / "bench_communication.png")
    return "\n".join(lines) + "\n"
